"""Published large-model measurements reproduced by the cost model (no fitting: default efficiencies)."""

import dataclasses

import pytest

from rpegjax.perf import pretraining
from rpegjax.perf.pretraining import Recompute
from rpegjax.perf.validation import KORTHIKANTI_2022, selene


@pytest.mark.parametrize("run", KORTHIKANTI_2022, ids=lambda run: run.name)
def test_megatron_iteration_times_within_20_percent(run):
    hardware = selene(run.devices)
    predicted = pretraining.iteration_seconds(run, hardware)["seconds"]
    assert predicted == pytest.approx(run.measured_seconds, rel=0.20)
    # the MFU formula gives the published utilisation back from the published time
    assert pretraining.model_flops_utilisation(run, run.measured_seconds, hardware) == pytest.approx(run.measured_mfu, abs=0.002)


def test_pipeline_bubble_and_recomputation_cost_time():
    run = KORTHIKANTI_2022[1]
    hardware = selene(run.devices)
    base = pretraining.iteration_seconds(run, hardware)
    assert base["schedule"] == pytest.approx((base["micro_batches"] + run.pipeline - 1) * base["per_micro_batch"])
    full = pretraining.iteration_seconds(dataclasses.replace(run, recompute=Recompute.FULL), hardware)
    assert full["seconds"] > base["seconds"]
    with pytest.raises(ValueError, match="do not split into 7 stages"):
        pretraining.iteration_seconds(dataclasses.replace(run, pipeline=7), hardware)
