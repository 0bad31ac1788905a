"""The FP8 quantisation of fabric_lib.weights.quantize_fp8 in plain PyTorch ops (no fabric
code): the tests' reference (DeepSeek-V3's format: one scale per 128 x 128 tile, scale =
amax / 448, e4m3 rounded to nearest even)."""

import torch


def fp8_reference(src, block=128):
    """The same quantisation in plain PyTorch ops (no fabric code): the tests' reference.
    Returns (e4m3 bits as uint8, f32 scales)."""
    x = src.float()
    rows, cols = x.shape
    tr, tc = (rows + block - 1) // block, (cols + block - 1) // block
    padded = torch.zeros(tr * block, tc * block)
    padded[:rows, :cols] = x.abs()
    amax = padded.view(tr, block, tc, block).amax(dim=(1, 3))
    scales = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    per_elem = scales.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    q = (x / per_elem).clamp(-448.0, 448.0)
    a = q.abs()
    # e4m3: exponent bias 7, 3 mantissa bits, subnormals below 2^-6 in steps of 2^-9.
    _, e = torch.frexp(a)  # a = m * 2^e, m in [0.5, 1)
    step_exp = torch.clamp(e - 1, min=-6) - 3
    r = torch.round(a * torch.pow(2.0, -step_exp.float())) * torch.pow(2.0, step_exp.float())
    _, e2 = torch.frexp(r)
    normal = r >= 2.0 ** -6
    exp_field = torch.where(normal, e2 - 1 + 7, torch.zeros_like(e2))
    mant = torch.where(normal, (r / torch.pow(2.0, (e2 - 1).float()) - 1.0) * 8.0, r * 512.0)
    bits = exp_field * 8 + mant.round().to(torch.int64)
    sign = torch.signbit(q).to(torch.int64) * 128
    return (bits + sign).to(torch.uint8), scales
