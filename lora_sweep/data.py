"""Data: read rows, tokenise them once for the whole job, and give each trial its own
shuffled stream of samples. Microbatches put each adapter's samples in consecutive rows.

Rows are `{"prompt", "completion"}` (the loss counts completion tokens only) or `{"text"}`
(the loss counts every token). Prompt and padding positions get the label -100.
"""

from __future__ import annotations

import codecs
import json
import logging
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from .config import ConfigError
from .kernels.reference import IGNORE_INDEX  # the loss's: one value for labels and loss

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    input_ids: tuple[int, ...]
    labels: tuple[int, ...]  # IGNORE_INDEX where no loss is taken

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def loss_tokens(self) -> int:
        # The first label never counts: position t predicts token t + 1.
        return sum(1 for lab in self.labels[1:] if lab != IGNORE_INDEX)


def load_rows(source: Any, field_name: str) -> list[dict]:
    """Rows from a .jsonl/.json path, a list of dicts, or a `datasets.Dataset`. Files are read
    as UTF-8 (a leading byte-order mark is skipped); every failure is a `ConfigError` naming
    the file, the row and the field."""
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        rows = _read_file(path, field_name)
        where = f"`{field_name}` ({path!r})"
    elif isinstance(source, Iterable) and not isinstance(source, (dict, bytes, str)):
        rows = list(source)  # a list of dicts or a datasets.Dataset (iterates dicts)
        where = f"`{field_name}`"
    else:
        raise ConfigError(f"`{field_name}` must be a path, a list of dicts or a datasets.Dataset, "
                          f"got {type(source).__name__}.", field=field_name)
    if not rows:
        raise ConfigError(f"`{field_name}` is empty: at least one row is needed.", field=field_name)
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{where} row {i} is a {type(row).__name__}, not a dict.", field=field_name)
        keys = ("prompt", "completion") if "prompt" in row or "completion" in row else ("text",)
        for k in keys:
            if k not in row:
                raise ConfigError(f"{where} row {i} has keys {sorted(row)}; rows need "
                                  "{'prompt', 'completion'} or {'text'}.", field=field_name)
            if not isinstance(row[k], str):
                raise ConfigError(f"{where} row {i} field {k!r} is a {type(row[k]).__name__}, "
                                  "not a string.", field=field_name)
            try:
                row[k].encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a JSON "\ud800" escape
                raise ConfigError(f"{where} row {i} field {k!r} is not valid Unicode: {e.reason} at "
                                  f"character {e.start}.", field=field_name) from None
    return rows


def _read_file(path: str, field_name: str) -> list:
    if os.path.isdir(path):
        raise ConfigError(f"`{field_name}` {path!r} is a directory; give a .jsonl or .json file.", field=field_name)
    if not os.path.exists(path):
        raise ConfigError(f"`{field_name}` file {path!r} does not exist.", field=field_name)
    if not path.endswith((".jsonl", ".json")):
        raise ConfigError(f"`{field_name}` must be a .jsonl or .json file, got {path!r}.", field=field_name)
    with open(path, "rb") as f:
        raw = f.read()
    if path.endswith(".jsonl"):
        rows = []
        for i, line in enumerate(raw.split(b"\n")):
            text = _decode(line[3:] if i == 0 and line.startswith(codecs.BOM_UTF8) else line, path, field_name,
                           f"line {i + 1}")
            if text.strip():
                try:
                    rows.append(json.loads(text))
                except json.JSONDecodeError as e:
                    raise ConfigError(f"`{field_name}` line {i + 1} of {path!r} is not JSON: {e}.",
                                      field=field_name) from None
        return rows
    text = _decode(raw[3:] if raw.startswith(codecs.BOM_UTF8) else raw, path, field_name, "file")
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"`{field_name}` file {path!r} is not JSON: {e}.", field=field_name) from None
    if not isinstance(rows, list):
        raise ConfigError(f"`{field_name}` file {path!r} holds a JSON {type(rows).__name__}, but must hold a "
                          "list of rows (a JSON array of objects); for one row per line use .jsonl.", field=field_name)
    return rows


def _decode(data: bytes, path: str, field_name: str, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        place = f"line {line}" if where == "file" else where
        raise ConfigError(f"`{field_name}` {place} of {path!r} is not valid UTF-8 (byte {e.start} of "
                          f"{'the file' if where == 'file' else 'the line'}: {e.reason}).", field=field_name) from None


def tokenize_rows(rows: Sequence[dict], tokenizer, max_seq_len: int, field_name: str) -> list[Sample]:
    """Tokenise every row once. Rows longer than `max_seq_len` are truncated (warned once, with
    the count); rows left with no loss token (an empty completion) are dropped, also counted."""
    eos = tokenizer.eos_token_id
    # No token spans more characters than the vocabulary's longest entry, so a string cut to
    # max_seq_len such tokens (twice over, for merges near the cut) still yields all the
    # max_seq_len tokens kept: a huge row costs no more than a long one.
    max_chars = 2 * max_seq_len * _longest_token_chars(tokenizer) + 64
    samples, truncated, dropped = [], 0, 0
    for row in rows:
        if "text" in row and "prompt" not in row:
            ids = _encode(tokenizer, row["text"][:max_chars], True) + ([eos] if eos is not None else [])
            labels = list(ids)
        else:
            prompt = _encode(tokenizer, row["prompt"][:max_chars], True)
            completion = _encode(tokenizer, row["completion"][:max_chars], False)
            if not completion:
                dropped += 1
                continue
            completion += [eos] if eos is not None else []
            ids = prompt + completion
            labels = [IGNORE_INDEX] * len(prompt) + completion
        if len(ids) > max_seq_len:
            truncated += 1
            ids, labels = ids[:max_seq_len], labels[:max_seq_len]
        sample = Sample(tuple(ids), tuple(labels))
        if sample.loss_tokens == 0:
            dropped += 1
            continue
        samples.append(sample)
    if truncated:
        warnings.warn(f"{truncated} of {len(rows)} `{field_name}` rows are longer than max_seq_len="
                      f"{max_seq_len} tokens and were truncated.", stacklevel=2)
    if dropped:
        warnings.warn(f"{dropped} of {len(rows)} `{field_name}` rows have no token to learn from "
                      "(empty completion, or the prompt fills max_seq_len) and were dropped.", stacklevel=2)
    if not samples:
        raise ConfigError(f"`{field_name}` has no usable row after tokenisation "
                          f"({len(rows)} rows, {dropped} dropped).", field=field_name)
    return samples


def _longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest entry (64 if the tokenizer has no vocabulary to read)."""
    try:
        return max(1, max(len(token) for token in tokenizer.get_vocab()))
    except (AttributeError, TypeError, ValueError, NotImplementedError):
        return 64


def _encode(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


class SampleStream:
    """A trial's endless sample order: a fresh permutation of the data every epoch, drawn
    from the trial's seed. `state()` / `load_state()` give the cursor for checkpoints."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            if self.position == self.num_samples:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            out.append(int(self._order[self.position]))
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)


def collate(groups: Sequence[Sequence[Sample]], pad_id: int, device, length: int | None = None,
            packed: bool = False) -> dict:
    """One microbatch: the groups' samples in group order (an adapter's tokens stay contiguous).

    Two layouts:

    * padded: one row per sample, right-padded to `length` (None: the longest sample). Right
      padding, so real tokens never see padding under causal attention.
    * packed: every sample back to back in a single row, no padding. Position ids restart at
      every sample and `cu_seq_lens` (the samples' start offsets, then the row's length) tells
      `attention.packed_attention` where samples begin, so none attends to another.

    Returns the model inputs (`input_ids`, and `attention_mask` and HF-style unshifted `labels`,
    or `position_ids`, `cu_seq_lens` and `max_length`), `targets` (the next token's label within
    the same sample, -100 elsewhere), `keep_index` (flat positions with a target, found on the
    host so that selecting them on a GPU needs no sync) and `seg_tokens` (each group's tokens,
    the padding that follows its samples included).
    """
    ids, targets, positions, seg_tokens, labels = [], [], [], [], []
    if packed:
        starts = [0]
        for group in groups:
            seg_tokens.append(sum(len(s) for s in group))
            for s in group:
                ids += s.input_ids
                targets += list(s.labels[1:]) + [IGNORE_INDEX]
                positions += range(len(s))
                starts.append(starts[-1] + len(s))
        ids, targets, positions = [ids], [targets], [positions]
    else:
        length = length or max(len(s) for g in groups for s in g)
        for group in groups:
            for s in group:
                pad = length - len(s)
                ids.append(list(s.input_ids) + [pad_id] * pad)
                labels.append(list(s.labels) + [IGNORE_INDEX] * pad)
                targets.append(list(s.labels[1:]) + [IGNORE_INDEX] * (pad + 1))
                positions.append([1] * len(s) + [0] * pad)  # the attention mask
            seg_tokens.append(len(group) * length)
    targets_t = torch.tensor(targets, dtype=torch.long)
    batch = {
        "input_ids": to_device(ids, torch.long, device),
        "targets": to_device(targets_t, torch.long, device),
        "keep_index": to_device((targets_t.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1), torch.long, device),
        "seg_tokens": seg_tokens,
    }
    if packed:
        batch["position_ids"] = to_device(positions, torch.long, device)
        batch["cu_seq_lens"] = to_device(starts, torch.int32, device)
        batch["max_length"] = max(b - a for a, b in zip(starts[:-1], starts[1:]))
    else:
        batch["attention_mask"] = to_device(positions, torch.long, device)
        batch["labels"] = to_device(labels, torch.long, device)  # unshifted, as HF models take them
    return batch


def to_device(data, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list or tensor on `device`. On CUDA it goes through pinned memory and is
    copied asynchronously: a plain copy from pageable memory makes the host wait until the
    GPU has finished all the work queued before it, and a step makes a dozen of them."""
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.to(dtype).pin_memory().to(device, non_blocking=True)
