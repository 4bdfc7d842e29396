"""The Triton kernels of `decode_attention` (imported only where they run: this module needs Triton). Module-level
functions, so that Triton's interpreter, which runs a kernel's source against its module's globals, finds the
helpers the kernels call."""

import triton
import triton.language as tl


@triton.jit
def dot(a, b, DOT_F32: tl.constexpr):
    """a @ b with fp32 accumulation; DOT_F32 (Triton's interpreter, which has no bf16 arithmetic in numpy): the same
    exact products in fp32."""
    if DOT_F32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def softmax_step(s, m_i, l_i):
    """One tile of the online softmax: the tile's probabilities against the running maximum, the factor for
    what was summed so far, the new maximum and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def split_result(acc, m_i, l_i):
    """A split's output and log-sum-exp (0 and -inf where it saw no key)."""
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    return out, tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))


@triton.jit
def split_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, slopes_ptr, scale,
                 stride_qn, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 stride_btn, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                 PAGE: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                 PART: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr, ALIBI: tl.constexpr):
    r = tl.program_id(0)
    kh = tl.program_id(1)
    sp = tl.program_id(2)
    kv_len = tl.load(len_ptr + r)
    start = sp * PART
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    heads = kh * GROUP + g
    g_ok = g < GROUP
    m_i = tl.full((G_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    if start < kv_len:
        q = tl.load(q_ptr + r * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None],
                    other=0.0)
        for t0 in range(0, PART, BLOCK_T):
            t = start + t0 + tl.arange(0, BLOCK_T)
            t_ok = t < kv_len
            page = tl.load(bt_ptr + r * stride_btn + t // PAGE, mask=t_ok, other=0).to(tl.int64)
            slot = t % PAGE
            k = tl.load(k_ptr + (page * stride_kb + slot * stride_kt + kh * stride_kh)[:, None] + d[None, :],
                        mask=t_ok[:, None], other=0.0)
            s = dot(q, tl.trans(k), DOT_F32) * scale
            if ALIBI:  # slope_h * (j - i), the query at position kv_len - 1
                slope = tl.load(slopes_ptr + heads, mask=g_ok, other=0.0)
                s = s + slope[:, None] * (t - (kv_len - 1)).to(tl.float32)[None, :]
            s = tl.where(t_ok[None, :], s, float("-inf"))
            p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
            v = tl.load(v_ptr + (page * stride_vb + slot * stride_vt + kh * stride_vh)[:, None] + d[None, :],
                        mask=t_ok[:, None], other=0.0)
            acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_F32)
            m_i = m_new
    out, lse = split_result(acc, m_i, l_i)
    tl.store(o_ptr + r * stride_on + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out,
             mask=g_ok[:, None])
    tl.store(lse_ptr + r * stride_ln + heads * stride_lh + sp, lse, mask=g_ok)


@triton.jit
def combine_kernel(o_ptr, lse_ptr, y_ptr, splits, stride_on, stride_oh, stride_os, stride_ln, stride_lh,
                   stride_yn, stride_yh, S_PAD: tl.constexpr, D: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    s_ok = s < splits
    lse = tl.load(lse_ptr + r * stride_ln + h * stride_lh + s, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    total = tl.sum(w, 0)
    o = tl.load(o_ptr + r * stride_on + h * stride_oh + s[:, None] * stride_os + d[None, :], mask=s_ok[:, None],
                other=0.0)
    y = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(y_ptr + r * stride_yn + h * stride_yh + d, y.to(y_ptr.dtype.element_ty))


@triton.jit
def mla_split_kernel(q_ptr, c_ptr, bt_ptr, len_ptr, o_ptr, lse_ptr, scale, heads_total,
                     stride_qn, stride_qh, stride_cb, stride_ct, stride_btn, stride_on, stride_oh, stride_os,
                     stride_ln, stride_lh, PAGE: tl.constexpr, HB: tl.constexpr, D: tl.constexpr,
                     DR: tl.constexpr, PART: tl.constexpr, BLOCK_T: tl.constexpr, DOT_F32: tl.constexpr):
    r = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    kv_len = tl.load(len_ptr + r)
    start = sp * PART
    heads = hb * HB + tl.arange(0, HB)
    h_ok = heads < heads_total
    d = tl.arange(0, D)
    dr = tl.arange(0, DR)
    m_i = tl.full((HB,), float("-inf"), tl.float32)
    l_i = tl.zeros((HB,), tl.float32)
    acc = tl.zeros((HB, D), tl.float32)
    if start < kv_len:
        q_row = q_ptr + r * stride_qn + heads[:, None] * stride_qh
        qn = tl.load(q_row + d[None, :], mask=h_ok[:, None], other=0.0)
        qr = tl.load(q_row + D + dr[None, :], mask=h_ok[:, None], other=0.0)
        for t0 in range(0, PART, BLOCK_T):
            t = start + t0 + tl.arange(0, BLOCK_T)
            t_ok = t < kv_len
            page = tl.load(bt_ptr + r * stride_btn + t // PAGE, mask=t_ok, other=0).to(tl.int64)
            row = c_ptr + page * stride_cb + (t % PAGE) * stride_ct
            kn = tl.load(row[:, None] + d[None, :], mask=t_ok[:, None], other=0.0)  # the latent: key and value
            kr = tl.load(row[:, None] + D + dr[None, :], mask=t_ok[:, None], other=0.0)  # the rotated part
            s = (dot(qn, tl.trans(kn), DOT_F32) + dot(qr, tl.trans(kr), DOT_F32)) * scale
            s = tl.where(t_ok[None, :], s, float("-inf"))
            p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
            acc = acc * alpha[:, None] + dot(p.to(kn.dtype), kn, DOT_F32)  # the latent is the value
            m_i = m_new
    out, lse = split_result(acc, m_i, l_i)
    tl.store(o_ptr + r * stride_on + heads[:, None] * stride_oh + sp * stride_os + d[None, :], out,
             mask=h_ok[:, None])
    tl.store(lse_ptr + r * stride_ln + heads * stride_lh + sp, lse, mask=h_ok)
