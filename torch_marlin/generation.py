"""Greedy decoding of a Hugging Face causal LM over a static KV cache, optionally with the one-token
decode step compiled once by ``torch.compile`` and/or captured once as a CUDA graph and replayed for
every later token.

A decode step at small batch is bound by host work (Python, the dispatcher, kernel launches), not
by the weight reads: replaying a captured graph removes all of it. The capture covers the model's
forward (every layer, float or quantized), the cache update and the greedy choice of the next
token; the inputs (token, position) live in static tensors that each step overwrites first.
Works for any model whose forward takes ``past_key_values``, ``cache_position`` and
``position_ids`` (transformers' Llama, Mistral, Qwen, SmolLM, ...). Needs ``transformers``.

``compile``: the decode step (model forward, cache update, greedy choice) is compiled once, at the
first step: the prompt runs eagerly first (a prompt of another length would be another graph),
which also allocates the cache, so every step sees the same cache objects in the same state; the
step's inputs are the same static tensors every time (the position is a tensor, not a Python int).
So one graph serves every layer and every step: no recompiles. With inductor (the default backend,
no ``mode``) the step's kernels launch behind the previous kernel (inductor's
``triton.enable_pdl``; on GPUs of compute capability 9.0 and up, ignored elsewhere), as the
library's kernels do: each kernel's launch overlaps the previous kernel's end
(docs/benchmarks.md "End to end" has the measured gain). ``compile_options`` may set it otherwise.

The cache is transformers' ``StaticCache``, except that its full-attention layers after the first
write each forward's keys and values at the positions the decoder hands the model: transformers'
layer builds its positions from its own length counter and advances that counter, work repeated
in every layer of every step (docs/benchmarks.md "End to end" has the measured gain). The first
such layer keeps its counter, which the others report as their length; sliding-window layers are
left as they are.

    dec = StaticDecoder(model, batch_size=1, max_length=256, cuda_graph=True, compile=True)
    tokens = dec.generate(input_ids, new_tokens=64)
"""

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Vocabulary entries a block of the greedy choice reduces (greedy_tokens).
GREEDY_CHUNK = 1024


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` for ``[batch, vocab]`` logits, as two reductions: the maximum of each
    chunk of GREEDY_CHUNK entries, then the best chunk. Compiled, a one-row argmax over a 128k
    vocabulary is one GPU block's work (about 30 us on an H200); the chunks spread it over the GPU.
    Ties go to the lowest index, as argmax's do (each chunk's first maximum, then the first chunk
    holding the maximum); a NaN wins as in argmax."""
    batch, vocab = logits.shape
    pad = -vocab % GREEDY_CHUNK
    if pad:
        logits = F.pad(logits, (0, pad), value=float("-inf"))
    best, where = logits.view(batch, -1, GREEDY_CHUNK).max(-1)
    chunk = best.argmax(-1, keepdim=True)
    return (chunk * GREEDY_CHUNK + where.gather(-1, chunk)).squeeze(-1)


def _decoder_cache(config, max_length: int):
    """transformers' StaticCache whose full-attention layers after the first write at
    ``cache.write_positions`` (set by StaticDecoder before each forward)."""
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer

    class PositionedLayer(StaticLayer):
        def __init__(self, max_cache_len: int, cache, counter: StaticLayer):
            super().__init__(max_cache_len)
            self.cache, self.counter = cache, counter

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            positions = self.cache.write_positions
            try:
                self.keys.index_copy_(2, positions, key_states)
                self.values.index_copy_(2, positions, value_states)
            except NotImplementedError:  # as StaticLayer: devices without index_copy_ (MPS)
                self.keys[:, :, positions] = key_states
                self.values[:, :, positions] = value_states
            return self.keys, self.values

        def get_seq_length(self):
            return self.counter.get_seq_length()

    cache = StaticCache(config=config, max_cache_len=max_length)
    cache.write_positions = None
    full = [i for i, layer in enumerate(cache.layers) if type(layer) is StaticLayer]
    for i in full[1:]:
        cache.layers[i] = PositionedLayer(max_length, cache, cache.layers[full[0]])
    return cache


def _compile_options(user: Optional[dict]) -> dict:
    """``user``'s torch.compile arguments with inductor's dependent launch on (module docstring),
    unless they choose another backend or a ``mode`` (torch.compile takes a mode or options, not
    both) or set it themselves."""
    from torch._inductor import config as inductor_config  # loaded on first use, not with torch_marlin

    opts = dict(user or {})
    if (opts.get("backend", "inductor") == "inductor" and "mode" not in opts
            and hasattr(inductor_config.triton, "enable_pdl")):  # older torch has no such option
        opts["options"] = {"triton.enable_pdl": True, **opts.get("options", {})}
    return opts


class StaticDecoder:
    """Greedy decoding of ``model`` for ``batch_size`` sequences of up to ``max_length`` tokens
    (prompt included). ``cuda_graph``: capture the decode step (CUDA only) at its first call;
    every later step is one graph replay. The graph holds the cache's and the model's tensors:
    keep the model's weights where they are while the decoder lives. ``compile``: the decode step
    compiled by ``torch.compile`` (``dynamic=False``) at its first call, the prompt run eagerly;
    ``compile_options``: more keyword arguments for ``torch.compile`` (``backend``, ``mode``, ...)."""

    def __init__(self, model: nn.Module, batch_size: int, max_length: int, cuda_graph: bool = False,
                 compile: bool = False, compile_options: Optional[dict] = None):
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"model must be a Hugging Face causal LM (an nn.Module with a config), got "
                            f"{type(model).__name__}")
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        if compile_options is not None and not compile:
            raise ValueError("compile_options is given but compile=False: pass compile=True or drop compile_options")
        self.model, self.batch_size, self.max_length = model, batch_size, max_length
        self.device = next(model.parameters()).device
        if cuda_graph and self.device.type != "cuda":
            raise ValueError(f"cuda_graph needs a model on a CUDA device, this one is on {self.device}")
        self.cuda_graph, self.compiled = cuda_graph, compile
        self._decode = (torch.compile(self._decode_step, dynamic=False, **_compile_options(compile_options))
                        if compile else self._decode_step)
        self.cache = _decoder_cache(model.config, max_length)
        self._tokens = torch.zeros(batch_size, 1, dtype=torch.long, device=self.device)
        self._position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self._graph_outputs = (None, None)  # (logits, next tokens) the captured step writes
        self.logits: Optional[torch.Tensor] = None  # [batch, vocab] of the latest step
        self._next: Optional[torch.Tensor] = None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.cache.write_positions = positions
        out = self.model(input_ids=input_ids, past_key_values=self.cache, cache_position=positions,
                         position_ids=positions.unsqueeze(0).expand(input_ids.shape[0], -1), use_cache=True,
                         logits_to_keep=1)
        return out.logits[:, -1]

    @torch.inference_mode()
    def prefill(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Empties the cache, runs the prompt ``[batch, P]`` (eagerly) and returns the first new
        token of each sequence ``[batch]``."""
        if input_ids.dim() != 2 or input_ids.shape[0] != self.batch_size:
            raise ValueError(f"input_ids must be [batch_size={self.batch_size}, P], got {tuple(input_ids.shape)}")
        if input_ids.shape[1] >= self.max_length:
            raise ValueError(f"the prompt ({input_ids.shape[1]} tokens) leaves no room in max_length={self.max_length}")
        self.cache.reset()  # in place: a captured step keeps pointing at the same cache tensors
        positions = torch.arange(input_ids.shape[1], device=self.device)
        self.logits = self._forward(input_ids.to(self.device), positions)
        return self.logits.argmax(-1)

    def _decode_step(self, tokens: torch.Tensor, position: torch.Tensor):
        logits = self._forward(tokens, position)
        # The chunks are for inductor, whose one-row argmax is one block's work; uncompiled, aten's
        # argmax is one kernel that splits a long row over blocks itself.
        return logits, (greedy_tokens(logits) if self.compiled else logits.argmax(-1))

    def _step_body(self) -> None:
        self.logits, self._next = self._decode(self._tokens, self._position)

    def _counters(self) -> List[torch.Tensor]:
        # Cache layers that count their own length (a tensor advanced in place by every update).
        return [layer.cumulative_length for layer in getattr(self.cache, "layers", ())
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor)]

    def _capture(self) -> None:
        # Warm-up runs on a side stream (lazy initializations, library handles) before capture, as
        # torch.cuda.graph requires. They write this step's keys and values once more (the same
        # values) and advance the cache's own length counters, which are restored afterwards.
        saved = [c.clone() for c in self._counters()]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        for c, s in zip(self._counters(), saved):
            c.copy_(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step_body()
        self._graph = graph
        # Every replay writes these tensors; prefill rebinds self.logits to its own (eager) output,
        # so step() binds them again after each replay.
        self._graph_outputs = (self.logits, self._next)

    @torch.inference_mode()
    def step(self, tokens: torch.Tensor, position: int) -> torch.Tensor:
        """Feeds ``tokens`` ``[batch]`` at ``position`` (the number of tokens before them) and
        returns the next token of each sequence ``[batch]``. The result is a static tensor that the
        next step overwrites: clone it to keep it."""
        if not 0 < position < self.max_length:
            raise ValueError(f"position must be in [1, max_length={self.max_length}), got {position}")
        self._tokens.copy_(tokens.view(self.batch_size, 1))
        self._position.fill_(position)
        if not self.cuda_graph:
            self._step_body()
        else:
            if self._graph is None:
                self._capture()
            self._graph.replay()
            self.logits, self._next = self._graph_outputs
        return self._next

    def generate(self, input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy continuation: ``[batch, new_tokens]`` token ids."""
        if new_tokens <= 0 or input_ids.shape[1] + new_tokens > self.max_length:
            raise ValueError(f"new_tokens must be in 1..{self.max_length - input_ids.shape[1]}, got {new_tokens}")
        out = [self.prefill(input_ids)]
        for i in range(1, new_tokens):
            out.append(self.step(out[-1], input_ids.shape[1] + i - 1).clone())
        return torch.stack(out, dim=1)
