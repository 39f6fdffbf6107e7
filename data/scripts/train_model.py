#!/usr/bin/env python3
"""Train (and evaluate) the small Mixtral-architecture LM bundled in data/model.

Pipeline::

    python data/scripts/build_corpus.py          # -> data/corpus/, data/heldout.txt
    python data/scripts/train_tokenizer.py       # -> data/model/tokenizer*.json
    python data/scripts/train_model.py           # -> data/model/ (weights, report)
    python data/scripts/train_model.py --eval-only   # re-run the final evaluation

Model: ``transformers.MixtralForCausalLM`` (sparse MoE, 8 experts, top-2),
trained from scratch on CPU with AdamW, linear warmup + cosine decay, weight
decay on matrices only.  The Mixtral built-in auxiliary loss is disabled
(``router_aux_loss_coef=0``); instead a *per-layer* switch-style load-balancing
loss  E * sum_e f_e * P_e  (f_e: share of (token, slot) assignments routed to
expert e, P_e: mean router probability of e) is computed for every layer and
averaged over layers, plus a small router z-loss.

Data: the training stream is every training piece followed by ``</s>``;
training windows are contiguous slices of ``ctx - 1`` tokens with ``<s>``
prepended (so ``<s>`` always marks the start of a context window).  Held-out
evaluation uses the same convention: the text is tokenised without special
tokens, cut into non-overlapping chunks of ``ctx - 1`` tokens, each chunk gets
``<s>`` prepended, and every text token is scored exactly once.

The checkpoint with the lowest validation loss (data/corpus/valid.jsonl, a
split disjoint from both training text and data/heldout.txt) is kept and saved
with ``save_pretrained`` in float16.  The final evaluation (held-out/train
perplexity, expert shares on held-out text, greedy samples) is computed from the
saved fp16 weights (upcast to fp32) and written to
``data/model/training_report.json``.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM

DATA_DIR = Path(__file__).resolve().parent.parent
BOS, EOS = 1, 2
PROMPTS = ["It is a truth universally acknowledged", "To be, or not to be"]


def load_jsonl(path: Path) -> list[str]:
    return [json.loads(line)["text"] for line in path.open(encoding="utf-8")]


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS)
    return np.asarray(ids, dtype=np.int64)


def eval_windows(ids: np.ndarray, ctx: int) -> list[torch.Tensor]:
    """Non-overlapping chunks of ctx-1 tokens, each with <s> prepended."""
    n = ctx - 1
    return [torch.from_numpy(np.concatenate([[BOS], ids[i:i + n]]))
            for i in range(0, len(ids), n)]


# --------------------------------------------------------------------------
# Router losses and statistics
# --------------------------------------------------------------------------
def router_losses(router_logits, top_k: int):
    """Per-layer load-balancing loss (averaged over layers) and router z-loss."""
    lb, z = 0.0, 0.0
    for logits in router_logits:  # [tokens, E] per layer
        logits = logits.float()
        n_exp = logits.shape[-1]
        probs = logits.softmax(-1)
        top = probs.topk(top_k, dim=-1).indices
        frac = F.one_hot(top, n_exp).float().sum(1).mean(0) / top_k  # f_e, sums to 1
        lb = lb + n_exp * (frac * probs.mean(0)).sum()
        z = z + torch.logsumexp(logits, -1).pow(2).mean()
    n = len(router_logits)
    return lb / n, z / n


@torch.no_grad()
def evaluate(model, windows, top_k: int, batch: int = 16, counts: bool = False):
    """Mean NLL per scored token (and optional per-layer expert counts)."""
    model.eval()
    tot_nll, tot_tok = 0.0, 0
    n_layers, n_exp = model.config.num_hidden_layers, model.config.num_local_experts
    cnt = np.zeros((n_layers, n_exp), dtype=np.int64)
    # group windows of equal length (only the last one can be shorter)
    groups: dict[int, list[torch.Tensor]] = {}
    for w in windows:
        groups.setdefault(len(w), []).append(w)
    for _, ws in groups.items():
        for i in range(0, len(ws), batch):
            x = torch.stack(ws[i:i + batch])
            out = model(input_ids=x, output_router_logits=counts, use_cache=False)
            logits = out.logits[:, :-1].float()
            nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                  x[:, 1:].reshape(-1), reduction="sum")
            tot_nll += nll.item()
            tot_tok += x[:, 1:].numel()
            if counts:
                for l, rl in enumerate(out.router_logits):
                    top = rl.float().topk(top_k, dim=-1).indices.reshape(-1)
                    cnt[l] += np.bincount(top.numpy(), minlength=n_exp)
    model.train()
    return tot_nll / tot_tok, tot_tok, cnt


# --------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------
def build_model(args, vocab: int) -> MixtralForCausalLM:
    cfg = MixtralConfig(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.max_pos,
        rope_theta=args.rope_theta,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
        router_jitter_noise=0.0,
        attention_dropout=args.attn_dropout,
        sliding_window=None,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=None,
        use_cache=True,
    )
    return MixtralForCausalLM(cfg)


def lr_at(step: int, args, elapsed: float = 0.0) -> float:
    """Linear warmup, then cosine decay to min_lr_frac * lr.

    Progress is the larger of the step fraction and the wall-clock fraction of
    --max-minutes, so the decay always completes inside the time budget.
    """
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    p_step = (step - args.warmup) / max(1, args.steps - args.warmup)
    p_time = elapsed / (args.max_minutes * 60)
    p = min(1.0, max(p_step, p_time))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train(args, tok: Tokenizer) -> dict:
    train_ids = token_stream(tok, load_jsonl(args.corpus / "train.jsonl"))
    valid_ids = token_stream(tok, load_jsonl(args.corpus / "valid.jsonl"))
    valid_w = eval_windows(valid_ids, args.ctx)
    print(f"train tokens {len(train_ids)}  valid tokens {len(valid_ids)}", flush=True)

    model = build_model(args, tok.get_vocab_size())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params / 1e6:.2f} M", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    n = args.ctx - 1
    rng = np.random.default_rng(args.seed)

    def epoch_starts():
        off = int(rng.integers(0, n))
        starts = np.arange(off, len(train_ids) - n, n)
        rng.shuffle(starts)
        return starts

    starts, pos, epoch = epoch_starts(), 0, 0
    best = {"valid_loss": float("inf"), "step": -1}
    history = []
    t0 = time.time()
    tokens_seen = 0
    model.train()
    step = 0
    for step in range(args.steps):
        if pos + args.batch > len(starts):
            starts, pos, epoch = epoch_starts(), 0, epoch + 1
        idx = starts[pos:pos + args.batch]
        pos += args.batch
        x = torch.from_numpy(np.stack([np.concatenate([[BOS], train_ids[s:s + n]]) for s in idx]))
        lr = lr_at(step, args, time.time() - t0)
        for g in opt.param_groups:
            g["lr"] = lr
        out = model(input_ids=x, output_router_logits=True, use_cache=False)
        logits = out.logits[:, :-1]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1))
        lb, z = router_losses(out.router_logits, args.top_k)
        loss = ce + args.lb_coef * lb + args.z_coef * z
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        tokens_seen += x.numel()
        elapsed = time.time() - t0
        if step % args.log_every == 0:
            print(f"step {step:5d} ep {epoch} lr {lr:.2e} ce {ce.item():.3f} "
                  f"lb {lb.item():.3f} z {z.item():.2f} gn {gnorm:.2f} "
                  f"tok/s {tokens_seen / elapsed:.0f} t {elapsed / 60:.1f}m", flush=True)
        last = step == args.steps - 1 or elapsed > args.max_minutes * 60
        if (step + 1) % args.eval_every == 0 or last:
            vl, _, _ = evaluate(model, valid_w, args.top_k)
            rec = {"step": step + 1, "epoch": epoch + pos / len(starts), "valid_loss": vl,
                   "valid_ppl": math.exp(vl), "train_ce": ce.item(), "minutes": elapsed / 60}
            rec["lr"] = lr
            history.append(rec)
            flag = ""
            if vl < best["valid_loss"]:
                best = dict(rec)
                torch.save(model.state_dict(), args.ckpt)
                flag = " *best*"
            print(f"== eval step {step + 1}: valid ppl {math.exp(vl):.2f}{flag}", flush=True)
            if len(history) >= args.patience + 1 and all(
                    h["valid_loss"] > best["valid_loss"] for h in history[-args.patience:]):
                print("early stop: validation loss stopped improving", flush=True)
                last = True
        if last:
            break
    wall = time.time() - t0
    model.load_state_dict(torch.load(args.ckpt))
    save_model(model, args.out)
    return {"params": n_params, "train_tokens": int(len(train_ids)),
            "valid_tokens": int(len(valid_ids)), "steps_run": step + 1,
            "tokens_seen": tokens_seen, "epochs_run": tokens_seen / len(train_ids),
            "train_wall_seconds": wall, "train_tokens_per_second": tokens_seen / wall,
            "best": best, "history": history}


def save_model(model: MixtralForCausalLM, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, do_sample=False,
                     max_new_tokens=64).save_pretrained(out)
    # Keep the classic flat keys too, for readers that predate rope_parameters.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta"))
    cfg["torch_dtype"] = "float16"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------
# Final evaluation
# --------------------------------------------------------------------------
def final_eval(args, tok: Tokenizer) -> dict:
    model = MixtralForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    model.eval()
    ctx, top_k = args.ctx, model.config.num_experts_per_tok
    held_ids = np.asarray(tok.encode(args.heldout.read_text(encoding="utf-8"),
                                     add_special_tokens=False).ids, dtype=np.int64)
    t = time.time()
    hl, hn, cnt = evaluate(model, eval_windows(held_ids, ctx), top_k, counts=True)
    held_sec = time.time() - t
    train_ids = token_stream(tok, load_jsonl(args.corpus / "train.jsonl"))
    rng = np.random.default_rng(args.seed + 1)
    starts = np.sort(rng.choice(len(train_ids) // (ctx - 1), size=args.train_eval_windows, replace=False))
    tw = [torch.from_numpy(np.concatenate([[BOS], train_ids[s * (ctx - 1):(s + 1) * (ctx - 1)]]))
          for s in starts]
    tl, tn, _ = evaluate(model, tw, top_k)
    shares = (cnt / cnt.sum(1, keepdims=True)).tolist()
    gens = {}
    for p in PROMPTS:
        x = torch.tensor([tok.encode(p).ids])  # <s> + prompt
        y = model.generate(x, max_new_tokens=40, do_sample=False)
        gens[p] = tok.decode(y[0].tolist(), skip_special_tokens=True)
    rep = {
        "heldout": {"file": "data/heldout.txt", "tokens_scored": hn, "nll": hl, "ppl": math.exp(hl),
                    "windows": f"non-overlapping chunks of {ctx - 1} tokens, <s> prepended to each",
                    "eval_seconds": held_sec, "eval_tokens_per_second": hn / held_sec},
        "train_sample": {"windows": len(tw), "tokens_scored": tn, "nll": tl, "ppl": math.exp(tl)},
        "expert_shares_heldout": {"definition": "share of (token, top-k slot) assignments per layer",
                                  "per_layer": shares,
                                  "counts": cnt.tolist()},
        "generations_greedy_40": gens,
        "weights_dtype": "float16",
        "weights_bytes": (args.out / "model.safetensors").stat().st_size,
    }
    print(json.dumps({k: v for k, v in rep.items() if k != "expert_shares_heldout"}, indent=2))
    for l, row in enumerate(shares):
        print(f"layer {l}: " + " ".join(f"{100 * s:5.1f}" for s in row))
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=DATA_DIR / "corpus")
    ap.add_argument("--heldout", type=Path, default=DATA_DIR / "heldout.txt")
    ap.add_argument("--out", type=Path, default=DATA_DIR / "model")
    ap.add_argument("--tokenizer-dir", type=Path, default=DATA_DIR / "model",
                    help="where train_tokenizer.py wrote tokenizer.json")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/moqe_best.pt"))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--max-pos", type=int, default=2048)
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--attn-dropout", type=float, default=0.0)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--lb-coef", type=float, default=0.02)
    ap.add_argument("--z-coef", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--patience", type=int, default=3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-minutes", type=float, default=34.0)
    ap.add_argument("--train-eval-windows", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-only", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # ship tokenizer with weights
        src = args.tokenizer_dir / name
        if src.resolve() != (args.out / name).resolve():
            (args.out / name).write_bytes(src.read_bytes())
    tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    report_path = args.out / "training_report.json"
    report = json.loads(report_path.read_text()) if args.eval_only and report_path.exists() else {}
    if not args.eval_only:
        report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        report["training"] = train(args, tok)
    report["final_eval"] = final_eval(args, tok)
    report["config"] = json.loads((args.out / "config.json").read_text())
    report["torch_version"] = torch.__version__
    import transformers, tokenizers  # noqa: E401
    report["transformers_version"] = transformers.__version__
    report["tokenizers_version"] = tokenizers.__version__
    report_path.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
