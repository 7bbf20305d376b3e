"""The weight formats' grids (weight_formats.py): a weight rounded to each, and back (the slow
references every quantized layer in quantized.py must equal).

    int8          a scale per output channel, -127..127
    int4          4-bit groups of 32 inputs with a scale and a minimum (the GGUF's Q4_1)
    8-bit groups  groups of 32 inputs with a scale, -127..127 (the GGUF's Q8_0)

A weight is rounded ROWS rows at a time, so that loading a model (files/weights.py) holds a
few MB of float32 temporaries beside it, never a whole LM head's. eight_bit_groups and
on_four_bit_grid tell whether a weight already lies on a grid (a file's own values, found
again to the bit). Shapes: N output features, K input features.
"""
import torch

GROUP = 32  # int4: input features that share a scale and a minimum (the GGUF's Q4_1 blocks)
# rows rounded at a time: each float32 temporary a few MB, where a whole LM head's took hundreds
# (a 32000 x 2048 head: 262 MB each, five at once) beside the model being loaded
ROWS = 1024


def by_rows(quantize, weight: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """quantize(weight), whose outputs are row by row, computed ROWS rows at a time, each chunk
    written into outputs made once (concatenating the chunks copied every output again)."""
    chunks = weight.split(ROWS)
    first = quantize(chunks[0])
    outputs = tuple(torch.empty((weight.shape[0], *t.shape[1:]), dtype=t.dtype) for t in first)
    for i, chunk in enumerate(chunks):
        for out, part in zip(outputs, first if i == 0 else quantize(chunk)):
            out[i * ROWS:i * ROWS + len(chunk)] = part
    return outputs


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> (N, K) int8 and (N,) float32 scales, symmetric per output channel:
    w ~= q * scale, scale = max |w| of the channel / 127 (round to nearest)."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # (N,)
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (N, K)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The slow reference: (N, K) int8 and (N,) scales -> the (N, K) float32 weight they hold."""
    return q.float() * scales[:, None]


def quantize_int4(weight: torch.Tensor):
    """(N, K) float -> q (N, K) int32 in 0..15, scales and minimums (N, K / GROUP) float32:
    w ~= q * scale + minimum, the group's minimum and (maximum - minimum) / 15, as Q4_1 does.
    A group of a 4-bit file holds its minimum at q = 0 and its maximum at q = 15, so this finds
    the file's own scale and minimum again."""
    return by_rows(quantize_int4_rows, weight)


def quantize_int4_rows(weight: torch.Tensor):
    N, K = weight.shape
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    minimums = w.amin(dim=-1)  # (N, K / GROUP)
    scales = (w.amax(dim=-1) - minimums) / 15
    steps = (w - minimums[..., None]) / scales.clamp(min=1e-30)[..., None]
    q = torch.round(steps).clamp(0, 15).to(torch.int32).view(N, K)
    return q, scales, minimums


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor):
    """The slow reference: the (N, K) float32 weight that quantize_int4's output holds."""
    N, K = q.shape
    w = q.view(N, K // GROUP, GROUP).float() * scales[..., None] + minimums[..., None]
    return w.view(N, K)


def quantize_int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> q (N, K) int8 in -127..127 and (N, K / GROUP) float32 scales, symmetric
    per group of GROUP inputs: w ~= q * scale, scale = the group's max |w| / 127, as Q8_0 does
    (so a Q8_0 file's groups, whose largest |q| is 127, are found again)."""
    return by_rows(quantize_int8_groups_rows, weight)


def quantize_int8_groups_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    N, K = weight.shape
    w = weight.detach().float().view(N, K // GROUP, GROUP)
    scales = w.abs().amax(dim=-1) / 127  # (N, K / GROUP)
    q = torch.round(w / scales.clamp(min=1e-30)[..., None]).clamp(-127, 127)
    return q.to(torch.int8).view(N, K), scales


def dequantize_int8_groups(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The slow reference: the (N, K) float32 weight that quantize_int8_groups's output holds."""
    N, K = q.shape
    return (q.view(N, K // GROUP, GROUP).float() * scales[..., None]).view(N, K)


def eight_bit_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """quantize_int8_groups's (q, scales), the scales rounded to float16 as the kernel reads
    them, if they hold this weight exactly (its groups of GROUP inputs are q * scale with q in
    -127..127 and a float16 scale: what a GGUF's Q8_0 holds) and the kernel's blocks of 16
    outputs fit it; else None."""
    N, K = weight.shape
    if K % GROUP or N % 16:
        return None
    q, scales = quantize_int8_groups(weight)
    scales = scales.half().float()
    exact = all(torch.equal(dequantize_int8_groups(q_rows, s_rows), rows.detach().float())
                for q_rows, s_rows, rows in zip(q.split(ROWS), scales.split(ROWS),
                                                weight.split(ROWS)))
    return (q, scales) if exact else None


def on_four_bit_grid(weight: torch.Tensor) -> bool:
    """Whether quantize_int4 keeps this weight as it is (to float32's rounding of the scale)."""
    if weight.shape[1] % GROUP:
        return False
    q, scales, minimums = quantize_int4(weight)
    error = max((dequantize_int4(*part) - rows.float()).abs().max()
                for *part, rows in zip(q.split(ROWS), scales.split(ROWS), minimums.split(ROWS),
                                       weight.split(ROWS)))
    return bool(error <= 1e-4 * scales.max())
