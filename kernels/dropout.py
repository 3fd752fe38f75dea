"""The dropout mask of the LoRA branch, drawn from a seed by a counter-based generator.

The mask is Philox4x32-10 exactly as Triton's `tl.randint(seed, offset)` computes it, here
in plain torch integer ops: the forward shrink draws it in registers (and stores it as
nibbles for the backward, `_triton_common`), and this module reproduces it bit for bit on
any device.

One Philox call gives four 32-bit words (`tl.randint4x`), so one call serves four
neighbouring columns: element (row, col) of an adapter's segment takes word `col % 4` of the
draw at counter `row * ceil(cols / 4) + col // 4`, where `row` counts from the start of
that adapter's own segment. A mask is therefore a pure function of the adapter's seed and
shape, whatever else is packed around it, and costs a quarter of a Philox per element.

The decision is made on integers, never on floats: the 32-bit draw is folded to 31 bits as
`tl.rand` does (`u < 0 ? ~u : u`) and an element is kept when it is >= `keep_threshold(p)`,
which makes P(keep) = 1 - p up to 2**-31 and leaves no rounding for devices to disagree on.
"""

from __future__ import annotations

import torch

_MASK32 = 0xFFFFFFFF
# Philox4x32 constants, as in triton/language/random.py.
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
PHILOX_ROUNDS = 10  # Triton's default (N_ROUNDS_DEFAULT)
_MAX_ELEMENTS_PER_STEP = 1 << 22  # bounds the int64 temporaries of one step (~32 MB each)


def check_dropout_p(p: float) -> float:
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"The value of `dropout_p` is {p}, but must be `0 <= dropout_p < 1`.")
    return p


def keep_threshold(p: float) -> int:
    """Integer threshold on the 31-bit draw: keep iff draw >= threshold (0 keeps everything)."""
    return min(int(round(check_dropout_p(p) * 2.0**31)), 2**31 - 1)


def normalize_seed(seed: int) -> int:
    """A seed as the int64 the kernels receive (two's complement of its low 64 bits)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return s - (1 << 64) if s >= (1 << 63) else s


def _mulhilo32(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) 32-bit halves of the 64-bit product of the constant `a` and uint32 values `b`
    (held in int64). Split `a` in 16-bit halves so that no product leaves int64."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    p_hi = b * a_hi  # < 2**48
    p_lo = b * a_lo  # < 2**48
    hi = (p_hi + (p_lo >> 16)) >> 16
    lo = (((p_hi & 0xFFFF) << 16) + p_lo) & _MASK32
    return hi, lo


def philox_randint4x(seed: int, offsets: torch.Tensor, n_rounds: int = PHILOX_ROUNDS) -> tuple[torch.Tensor, ...]:
    """`tl.randint4x(seed, offsets)` for int64 `offsets`: the four Philox4x32 output words,
    as int64 tensors holding uint32 values (the first is `tl.randint(seed, offsets)`)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    k0, k1 = s & _MASK32, (s >> 32) & _MASK32
    c0 = offsets & _MASK32
    c1 = (offsets >> 32) & _MASK32
    c2 = torch.zeros_like(c0)
    c3 = torch.zeros_like(c0)
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo32(_PHILOX_ROUND_B, c2)
        hi_a, lo_a = _mulhilo32(_PHILOX_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + _PHILOX_KEY_A) & _MASK32
        k1 = (k1 + _PHILOX_KEY_B) & _MASK32
    return c0, c1, c2, c3


def fold31(u: torch.Tensor) -> torch.Tensor:
    """The uint32 draw as `tl.rand` folds it before scaling: bitcast to int32, then `~x` if negative."""
    return torch.where(u >= 2**31, _MASK32 - u, u)


def dropout_keep_mask(seed: int, rows: int, cols: int, p: float, device=None) -> torch.Tensor:
    """Boolean keep-mask [rows, cols]: True with probability 1 - p, a pure function of `seed`.

    Bit-identical to the masks the Triton kernels draw in registers (`_triton_common.keep_mask`).
    """
    threshold = keep_threshold(p)
    out = torch.empty(rows, cols, dtype=torch.bool, device=device)
    if threshold == 0 or rows * cols == 0:
        return out.fill_(True)
    groups = -(-cols // 4)  # Philox counters per row
    step = max(1, _MAX_ELEMENTS_PER_STEP // (4 * groups))
    group_idx = torch.arange(groups, dtype=torch.int64, device=device)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        row_idx = torch.arange(r0, r1, dtype=torch.int64, device=device)
        words = philox_randint4x(seed, row_idx[:, None] * groups + group_idx[None, :])  # 4 x (rows, groups)
        draws = torch.stack(words, dim=-1).reshape(r1 - r0, 4 * groups)[:, :cols]  # word col % 4 of counter col // 4
        out[r0:r1] = fold31(draws) >= threshold
    return out


def empty_mask_nibbles(rows: int, cols: int, device) -> torch.Tensor:
    """Storage for a [rows, cols] keep-mask as the kernels keep it: uint8 [rows, ceil(cols / 4)],
    one nibble per group of four columns, bit w of group g keeping column 4 g + w."""
    return torch.empty(rows, (cols + 3) // 4, dtype=torch.uint8, device=device)


def keep_mask_from_nibbles(nibbles: torch.Tensor, cols: int) -> torch.Tensor:
    """The bool [rows, cols] keep-mask held in `nibbles` (see `empty_mask_nibbles`)."""
    shifts = torch.arange(4, device=nibbles.device, dtype=torch.uint8)
    unpacked = (nibbles[:, :, None] >> shifts) & 1
    return unpacked.reshape(nibbles.shape[0], -1)[:, :cols].bool()
