"""Float32 weights that are exactly GGUF block-quantized values, found and kept in the skinny kernel's block
formats (`skinny_matmul.cc`).

A GGUF checkpoint's Q4_1 and Q8_0 tensors dequantize (ggml `dequantize_row_q4_1` / `_q8_0`, gguf-py
`quants.Q4_1` / `Q8_0`) to float32 values of the form, per 32 consecutive inputs k of one output column n
(a block): w = q * d + m with q in [0, 15] and fp16 d, m (Q4_1), or w = q * d with q in [-127, 127] and an
fp16 d (Q8_0). `find_blocks` recovers q, d and m from the float32 values alone and checks that they
reproduce every value bit for bit; the kernel then streams 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight
instead of 4 and computes the same float32 sums. Found from values rather than carried from the file, it
holds through whatever the loader did to the columns (fused projections, Q/K row permutations, a reduced
output vocabulary) and for any checkpoint that holds such values (an orbax conversion of a GGUF).
"""

from __future__ import annotations

import os

import numpy as np

QK = 32  # inputs per block
PANEL = 16  # output columns per panel
FORMATS = {"q4_1": 1, "q8_0": 2}  # the kernel's `format` attribute
BLOCK_BYTES = {"q4_1": 64 + QK * PANEL // 2, "q8_0": 32 + QK * PANEL}
CHUNK = 256  # output columns examined at a time: a chunk's temporaries stay in cache


def enabled() -> bool:
    """Whether float32 weights may be kept in blocks (`JSE_WEIGHT_BLOCKS=0` in the environment keeps panels)."""
    return os.environ.get("JSE_WEIGHT_BLOCKS", "1") != "0"


def find_blocks(w: np.ndarray) -> tuple[str, np.ndarray] | None:
    """(format, panels): w's values as the kernel's block-format panels (`pack_blocks`), where every block of
    w is exactly q * d + m (float32 arithmetic, as the kernel widens) in one format; else None.

    w: float32 `[K, N]` with K a multiple of 32 (else None).
    """
    K, N = w.shape
    if K % QK or w.dtype != np.float32:
        return None
    for fmt in FORMATS:
        parts = []
        for j in range(0, N, CHUNK):  # CHUNK is whole panels, so the chunks' panels concatenate
            found = _find(np.ascontiguousarray(w[:, j:j + CHUNK]).reshape(K // QK, QK, -1), fmt)
            if found is None:
                break
            parts.append(pack_blocks(fmt, *found))
        else:
            return fmt, np.concatenate(parts)
    return None


def _find(b: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """q, d, m of blocks `b` `[K/32, 32, n]` in `fmt`, or None."""
    if not np.isfinite(b).all():
        return None
    if fmt == "q4_1":
        # q = 0 sits at the block's minimum (quantize_row_q4_1 maps min to 0 and max to 15).
        m = b.min(axis=1)
        if not np.array_equal(m.astype(np.float16).astype(np.float32), m):
            return None
        d, lo, hi, qtype = ((b.max(axis=1) - m) / 15).astype(np.float16), 0, 15, np.uint8
    else:
        # The largest magnitude is 127 d (quantize_row_q8_0: d = amax / 127).
        m = np.zeros(b.shape[::2], np.float32)
        d, lo, hi, qtype = (np.abs(b).max(axis=1) / 127).astype(np.float16), -127, 127, np.int8
    q = _check(b, d, m, lo, hi)
    return None if q is None else (q.astype(qtype), d, m.astype(np.float16))


def _check(b: np.ndarray, d16: np.ndarray, m: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
    """q `[K/32, 32, N]` in [lo, hi] with q * d + m == b for every value, trying d16's fp16 neighbours for the
    blocks its first value misses (d16 is updated in place), or None."""
    m = m[:, None, :]
    q = None
    for step in (0, 1, -1):
        d16_try = d16 if step == 0 else np.nextafter(d16, np.float16(np.inf if step > 0 else -np.inf))
        d = d16_try.astype(np.float32)[:, None, :]
        with np.errstate(divide="ignore", invalid="ignore"):
            q_try = np.clip(np.rint(np.where(d != 0, (b - m) / d, 0)), lo, hi).astype(np.float32)
        good = (q_try * d + m == b).all(axis=1)
        if step == 0:
            if good.mean() < 0.9:  # not this format: spare the neighbours' passes
                return None
            q, ok = q_try, good
        else:
            fix = ~ok & good
            d16[fix] = d16_try[fix]
            q = np.where(fix[:, None, :], q_try, q)
            ok |= good
        if ok.all():
            return q
    return None


def pack_blocks(fmt: str, q: np.ndarray, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """The kernel's panels uint8 `[ceil(N/16), K/32, BLOCK_BYTES[fmt]]` from `find_blocks`' q, d, m (columns
    past N padded with zero blocks)."""
    nb, _, N = q.shape
    n_pad = -(-N // PANEL) * PANEL
    pad = ((0, 0), (0, 0), (0, n_pad - N))
    q = np.pad(q, pad).reshape(nb, QK, n_pad // PANEL, PANEL).transpose(2, 0, 1, 3)  # [P, K/32, 32, 16]
    header = [np.pad(d, pad[1:]).reshape(nb, n_pad // PANEL, PANEL).transpose(1, 0, 2)]
    if fmt == "q4_1":
        header.append(np.pad(m, pad[1:]).reshape(nb, n_pad // PANEL, PANEL).transpose(1, 0, 2))
        # 64 bits a row, nibble i of 32-bit half c = column 2 i + c (little-endian: byte 4 c + i // 2)
        q = q.reshape(*q.shape[:3], 4, 2, 2)  # [..., byte pair b, nibble half h, c]: column 4 b + 2 h + c
        q = (q[..., 0, :] | (q[..., 1, :] << 4)).transpose(0, 1, 2, 4, 3).reshape(*q.shape[:3], 8)
    parts = [np.ascontiguousarray(h, np.float16).view(np.uint8) for h in header]
    parts.append(np.ascontiguousarray(q).view(np.uint8).reshape(*q.shape[:2], -1))
    return np.ascontiguousarray(np.concatenate(parts, axis=-1))


def unpack_blocks(fmt: str, panels: np.ndarray, n: int) -> np.ndarray:
    """The float32 `[K, n]` weight block-format `panels` stand for (the kernel's widening, in numpy)."""
    p, nb, _ = panels.shape
    d = panels[..., :32].copy().view(np.float16).astype(np.float32)  # [P, K/32, 16]
    if fmt == "q4_1":
        m = panels[..., 32:64].copy().view(np.float16).astype(np.float32)
        packed = panels[..., 64:].reshape(p, nb, QK, 2, 4)  # [..., c, byte b]
        q = np.stack([packed & 0x0F, packed >> 4], axis=-1)  # [..., c, b, h]: column 4 b + 2 h + c
        q = q.transpose(0, 1, 2, 4, 5, 3).reshape(p, nb, QK, PANEL).astype(np.float32)
    else:
        m = np.zeros_like(d)
        q = panels[..., 32:].copy().view(np.int8).reshape(p, nb, QK, PANEL).astype(np.float32)
    w = q * d[:, :, None, :] + m[:, :, None, :]  # [P, K/32, 32, 16]
    return w.transpose(1, 2, 0, 3).reshape(nb * QK, p * PANEL)[:, :n]
