"""Examples, prompt templating and resumable iteration; `rpegjax.data.jsonl` loads datasets (it imports
math-verify to check gold answers, so it is not imported here: reward workers import `Example` cheaply)."""

from rpegjax.data.example import SOLUTION_KEY, DatasetError, Example
from rpegjax.data.iterator import DataIterator
from rpegjax.data.prompts import ChatTokenizer, PromptTemplate

__all__ = ["SOLUTION_KEY", "ChatTokenizer", "DataIterator", "DatasetError", "Example", "PromptTemplate"]
