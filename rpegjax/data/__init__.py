"""Examples, prompt templating and resumable iteration. `rpegjax.data.files.load_examples` loads datasets
(JSONL, Parquet, Hugging Face `save_to_disk` directories; `rows` checks each row); those modules import
pyarrow, so they are not imported here: reward workers import `Example` cheaply."""

from rpegjax.data.example import SOLUTION_KEY, DatasetError, Example
from rpegjax.data.iterator import DataIterator
from rpegjax.data.prompts import ChatTemplateMode, ChatTokenizer, PromptTemplate

__all__ = ["SOLUTION_KEY", "ChatTemplateMode", "ChatTokenizer", "DataIterator", "DatasetError", "Example", "PromptTemplate"]
