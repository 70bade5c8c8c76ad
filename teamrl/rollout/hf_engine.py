"""Batched generation with Hugging Face models in this process (CPU or GPU).

A lean decode loop instead of ``model.generate``: identical prompts are prefilled once and
their KV cache rows copied to the samples that share them; logits are computed only for the
last position; sampling uses an inverse-CDF draw (``torch.multinomial`` spends ~30 ms per
step on a 49k vocabulary at batch 32 on CPU); finished rows leave the batch so later steps
only compute live sequences; per-row temperature, top-k and top-p are vectorised.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase

from teamrl.rollout.engine import Completion, Engine, GenerationRequest

# policy name -> context manager that yields the model computing with that policy's weights
ModelProvider = Callable[[str], "contextlib.AbstractContextManager[torch.nn.Module]"]


class HFEngine(Engine):
    """The in-process engine. ``models(policy)`` is a context manager yielding the model to use."""

    def __init__(self, models: ModelProvider, tokenizer: PreTrainedTokenizerBase, device: str | torch.device = "cpu",
                 extra_eos_ids: Sequence[int] = ()) -> None:
        self.models = models
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        eos = {tokenizer.eos_token_id, *extra_eos_ids}
        self.eos_ids = torch.tensor(sorted(e for e in eos if e is not None), dtype=torch.long, device=self.device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def generate(self, policy: str, requests: Sequence[GenerationRequest], seed: int | None = None) -> list[list[Completion]]:
        if not requests:
            return []
        with self.models(policy) as model:
            was_training = model.training
            model.eval()
            try:
                with torch.inference_mode():
                    rows = self._decode(model, requests, seed)
            finally:
                model.train(was_training)
        out: list[list[Completion]] = []
        k = 0
        for req in requests:
            out.append(rows[k:k + req.n])
            k += req.n
        return out

    def _decode(self, model: torch.nn.Module, requests: Sequence[GenerationRequest], seed: int | None) -> list[Completion]:
        dev = self.device
        gen = torch.Generator(device="cpu")
        gen.manual_seed(seed if seed is not None else torch.seed() % 2**63)

        # Unique prompts are prefilled once; each output row points at its prompt.
        unique: dict[tuple[int, ...], int] = {}
        row_prompt: list[int] = []
        row_params = []
        for req in requests:
            if req.n < 1:
                raise ValueError(f"GenerationRequest.n={req.n}: must be >= 1")
            if not req.prompt_ids:
                raise ValueError("GenerationRequest.prompt_ids is empty")
            u = unique.setdefault(tuple(req.prompt_ids), len(unique))
            row_prompt += [u] * req.n
            row_params += [req.params] * req.n
        R = len(row_prompt)
        prompts = list(unique)
        P = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), P), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, P - len(p):] = torch.tensor(p)
            attn[i, P - len(p):] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        padded = not bool(attn.all())
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        out = model(input_ids=ids, attention_mask=attn if padded else None, position_ids=pos,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        src = torch.tensor(row_prompt, device=dev)
        logits = out.logits[:, -1, :].index_select(0, src)
        if len(prompts) != R or row_prompt != list(range(R)):
            cache.reorder_cache(src)
        attn = attn.index_select(0, src)
        last_pos = pos[:, -1].index_select(0, src)

        temp = torch.tensor([p.temperature for p in row_params], dtype=torch.float32, device=dev)
        top_k = torch.tensor([p.top_k for p in row_params], dtype=torch.long, device=dev)
        top_p = torch.tensor([p.top_p for p in row_params], dtype=torch.float32, device=dev)
        max_new = torch.tensor([p.max_new_tokens for p in row_params], dtype=torch.long, device=dev)
        ignore_eos = torch.tensor([p.ignore_eos for p in row_params], dtype=torch.bool, device=dev)
        stops = [p.stop for p in row_params]
        stop_window = [max((len(s.encode()) for s in st), default=0) for st in stops]

        tokens: list[list[int]] = [[] for _ in range(R)]
        logps: list[list[float]] = [[] for _ in range(R)]
        finish = ["length"] * R
        live = torch.arange(R, device=dev)  # output row of each batch row
        steps = int(max_new.max())
        for t in range(steps):
            nxt, lp = _sample(logits, temp.index_select(0, live), top_k.index_select(0, live),
                              top_p.index_select(0, live), gen)
            nxt_l, lp_l, live_l = nxt.tolist(), lp.tolist(), live.tolist()
            done = torch.zeros(len(live_l), dtype=torch.bool)
            eos_hit = torch.isin(nxt, self.eos_ids) & ~ignore_eos.index_select(0, live)
            length_hit = max_new.index_select(0, live) <= t + 1
            for j, r in enumerate(live_l):
                tokens[r].append(nxt_l[j])
                logps[r].append(lp_l[j])
                if stop_window[r] and self._hits_stop(tokens[r], stops[r], stop_window[r]):
                    finish[r] = "stop"
                    done[j] = True
            for j in torch.nonzero(eos_hit).flatten().tolist():
                if not done[j]:
                    finish[live_l[j]] = "eos"
                done[j] = True
            done |= length_hit.cpu()
            if bool(done.all()):
                break
            keep = torch.nonzero(~done).flatten().to(dev)
            if len(keep) < len(live_l):
                live, nxt = live.index_select(0, keep), nxt.index_select(0, keep)
                attn, last_pos = attn.index_select(0, keep), last_pos.index_select(0, keep)
                cache.reorder_cache(keep)
            attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
            last_pos = last_pos + 1
            out = model(input_ids=nxt.unsqueeze(1), attention_mask=attn if padded else None,
                        position_ids=last_pos.unsqueeze(1), past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1, :]
        texts = self.tokenizer.batch_decode(tokens, skip_special_tokens=True)
        for r in range(R):
            if finish[r] == "stop":
                texts[r] = _cut_after_stop(texts[r], stops[r])
        return [Completion(tokens[r], logps[r], texts[r], finish[r]) for r in range(R)]

    def _hits_stop(self, toks: list[int], stop: tuple[str, ...], window_bytes: int) -> bool:
        # Each token is at least one byte, so the last `window_bytes + 1` tokens hold any stop string just completed.
        tail = self.tokenizer.decode(toks[-(window_bytes + 1):], skip_special_tokens=True)
        return any(s in tail for s in stop)


def _cut_after_stop(text: str, stops: tuple[str, ...]) -> str:
    cuts = [text.index(s) + len(s) for s in stops if s in text]
    return text[:min(cuts)] if cuts else text


def _sample(logits: torch.Tensor, temp: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
            gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row; return (tokens, their log-probs under softmax(logits / temp))."""
    logits = logits.float()
    greedy = temp == 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp).unsqueeze(1)
    logp = torch.log_softmax(scaled, dim=-1)
    filt = logp
    V = logp.shape[-1]
    k_on = (top_k > 0) & (top_k < V)
    p_on = top_p < 1
    if bool(k_on.any()) or bool(p_on.any()):
        sorted_lp, order = logp.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logp.device).unsqueeze(0)
        drop = k_on.unsqueeze(1) & (rank >= top_k.unsqueeze(1))
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it stays).
        mass_before = sorted_lp.exp().cumsum(-1) - sorted_lp.exp()
        drop |= p_on.unsqueeze(1) & (mass_before >= top_p.unsqueeze(1))
        sorted_lp = sorted_lp.masked_fill(drop, float("-inf"))
        filt = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp)
    probs = filt.exp()
    cdf = probs.cumsum(-1)
    u = torch.rand(probs.shape[0], 1, generator=gen).to(probs.device) * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u).squeeze(1).clamp_(max=V - 1)
    tok = torch.where(greedy, logits.argmax(-1), tok)
    ref_lp = torch.where(greedy.unsqueeze(1), torch.log_softmax(logits, -1), logp) if bool(greedy.any()) else logp
    return tok, ref_lp.gather(-1, tok.unsqueeze(1)).squeeze(1)
