"""Which GPTQ group-scale rule generalizes: int4 round-to-nearest, GPTQ with scales fixed from the original weights
(qconvert's), GPTQ with each group's scale set from the error-updated columns when the loop reaches it (the paper's
code; llm-compressor with static_groups off), per linear of a real LLM, all in float64 numpy.

    python bench/gguf_to_hf.py --model smollm2-135m --out /tmp/smollm2-135m
    python bench/gptq_group_scales.py [GROUP=64] [DAMP=0.1]

Inputs are captured with transformers (a test dependency) on calibration text (the machine's Debian license texts,
the GPL family left out, about 52,000 SmolLM2 tokens in windows of 512) and on held-out text (the last 20% of
Python's documentation topics, 16,384 tokens); the figure is |X (W - Q)^T|^2 / |X W^T|^2 on each, the Hessian from
the calibration inputs alone. Symmetric int4 as qconvert writes it: scale = absmax / 7.5, codes -8..7."""
import sys, glob
import numpy as np
import torch, transformers
from pydoc_data.topics import topics

MODEL = "/tmp/smollm2-135m"
G = int(sys.argv[1]) if len(sys.argv) > 1 else 64
DAMP = float(sys.argv[2]) if len(sys.argv) > 2 else 0.1
tok = transformers.AutoTokenizer.from_pretrained(MODEL)
model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32).eval()
calib_text = "\n\n".join(open(f, errors="ignore").read() for f in sorted(glob.glob("/usr/share/common-licenses/*"))
                         if not f.endswith(("GPL", "LGPL", "GFDL")))
doc = "\n\n".join(topics[k] for k in sorted(topics))
held_text = doc[int(len(doc) * 0.8):]
TARGETS = ["model.layers.5.mlp.down_proj", "model.layers.20.mlp.down_proj", "model.layers.5.self_attn.o_proj",
           "model.layers.20.mlp.up_proj", "model.layers.12.self_attn.q_proj", "model.layers.25.mlp.gate_proj"]

def capture(text, tokens, seqlen=512):
    ids = tok(text, return_tensors="pt").input_ids[0][:tokens]
    n = len(ids) // seqlen
    ids = ids[:n * seqlen].reshape(n, seqlen)
    got = {t: [] for t in TARGETS}
    hooks = [dict(model.named_modules())[t].register_forward_hook(
        lambda m, a, o, t=t: got[t].append(a[0].reshape(-1, a[0].shape[-1]).double().numpy())) for t in TARGETS]
    with torch.no_grad():
        for row in ids:
            model(row[None])
    for h in hooks:
        h.remove()
    return {t: np.concatenate(v) for t, v in got.items()}, n * seqlen

def scales_of(w):  # per row, per group: absmax / 7.5 as qconvert's int4 (codes -8..7)
    r, c = w.shape
    g = np.abs(w.reshape(r, c // G, G)).max(-1) / 7.5
    return np.where(g == 0, 1, g)

def q(x, s):
    return np.clip(np.round(x / s), -8, 7) * s

def rtn(w):
    s = np.repeat(scales_of(w), G, axis=1)
    return q(w, s)

def gptq(w, h, dynamic):
    w = w.copy()
    n = w.shape[1]
    dead = np.diag(h) == 0
    h = h.copy(); h[dead, dead] = 1; w[:, dead] = 0
    h = h + DAMP * np.mean(np.diag(h)) * np.eye(n)
    u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper, U^T U = H^-1
    fixed = np.repeat(scales_of(w), G, axis=1)
    out = np.zeros_like(w)
    s = None
    for j in range(n):
        if dynamic and j % G == 0:
            s = np.abs(w[:, j:j + G]).max(1) / 7.5
            s = np.where(s == 0, 1, s)
        sj = s if dynamic else fixed[:, j]
        out[:, j] = q(w[:, j], sj)
        err = (w[:, j] - out[:, j]) / u[j, j]
        w[:, j + 1:] -= np.outer(err, u[j, j + 1:])
    return out

def rel(x, w, qw):
    return np.sum((x @ (w - qw).T) ** 2) / np.sum((x @ w.T) ** 2)

cal, ncal = capture(calib_text, 65536)
held, nheld = capture(held_text, 16384)
print(f"group {G}, damp {DAMP}; calibration {ncal} tokens, held-out {nheld} tokens")
print(f"{'linear':34s} {'rtn':>9s} {'gptq-fixed':>11s} {'gptq-dyn':>9s}   (held-out; calib in brackets)")
params = dict(model.named_parameters())
for t in TARGETS:
    w = params[t + ".weight"].detach().double().numpy()
    h = cal[t].T @ cal[t]
    a, b, c = rtn(w), gptq(w, h, False), gptq(w, h, True)
    print(f"{t:34s} {rel(held[t], w, a):9.5f} {rel(held[t], w, b):11.5f} {rel(held[t], w, c):9.5f}   "
          f"[{rel(cal[t], w, a):.5f} {rel(cal[t], w, b):.5f} {rel(cal[t], w, c):.5f}]", flush=True)
