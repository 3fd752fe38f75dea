"""The tiny model and task bundled with the package, for demos, tests and CPU runs.

Both are built by `scripts/make_tiny_assets.py`: a 0.7M-parameter Llama (GQA,
byte-level BPE tokenizer) pretrained on a generated corpus about 40 animals and
their facts, and a task that asks for those facts in a new, terse format
(`{"prompt": "pig ? sound , size :", "completion": " moo , big ."}`), which a
short LoRA fine-tune learns at a good learning rate and not at a tiny one.
Intended `max_seq_len`: 64.

Example:
    spec = ls.JobSpec(base_model=tiny_model_path(), train_data=train, eval_data=eval_, max_seq_len=64)
    where `train, eval_ = tiny_task_paths()`.
"""

from pathlib import Path

_ASSETS = Path(__file__).parent / "assets"


def tiny_model_path() -> str:
    """Directory of the tiny Llama and its tokenizer; loads with `from_pretrained`, offline."""
    return str(_ASSETS / "tiny-llama")


def tiny_task_paths() -> tuple[str, str]:
    """Paths of the tiny task's `(train.jsonl, eval.jsonl)`: 2000 and 128 `{"prompt", "completion"}` rows."""
    return str(_ASSETS / "tiny-task" / "train.jsonl"), str(_ASSETS / "tiny-task" / "eval.jsonl")
