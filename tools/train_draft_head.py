"""Train the bundled model's draft head (issue 20) from its own answers (`data/draft_head/smollm2_selfdistill*.npz`).

Two phases, both resumable, their state in `--work-dir`:

1. Hidden states. One forward of the target over every stored sequence gives its last hidden state (the final
   norm's output) at every position, kept in float16, and its eight most likely next tokens with their
   probabilities (the soft labels). Sequences run in batches sorted by length; a rerun skips finished batches.
2. Training (`decodekit.models.draft_head.DraftHead`, EAGLE-1 style). At position `i` the head reads the target's
   state `f_i` and the embedding of `t_{i+1}` and predicts `f_{i+1}`:
   loss = SmoothL1(predicted, f_{i+1}) + cls_weight * cross-entropy(target's top-8 distribution at `i+1`, the
   head's distribution over the draft vocabulary). A second draft step is trained the way it runs (the head's own
   prediction as input, `DraftHead.forward_second`). The draft vocabulary is the `--draft-vocab` most frequent
   ids of the training sequences. One sequence in 20 of each file is held out: each epoch reports, per file, how
   often the head's top token equals the target's there, for the first and the second draft step. A checkpoint
   after every epoch; a rerun goes on from the last one.

Seeded: the same arguments give the same head on the same machine kind.

Usage: python tools/train_draft_head.py [--data data/draft_head/smollm2_selfdistill.npz ...]
       [--output decodekit/models/heads/smollm2-135m-instruct.safetensors] [--work-dir .cache/draft_head] [--epochs 6]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

TOP = 8  # soft labels kept per position


def hidden_states(model: torch.nn.Module, data: dict[str, np.ndarray], work: Path, batch_size: int) -> None:
    """Phase 1: write `features.npy` (float16 `[tokens, hidden]`), `top_ids.npy` and `top_probs.npy` to `work`."""
    tokens, starts, lengths = data["tokens"], data["starts"], data["lengths"]
    hidden = model.config.hidden_size
    work.mkdir(parents=True, exist_ok=True)
    progress_file = work / "features.progress"
    done = int(progress_file.read_text()) if progress_file.exists() else 0
    mode = "r+" if done else "w+"
    features = np.lib.format.open_memmap(work / "features.npy", mode=mode, dtype=np.float16,
                                         shape=(len(tokens), hidden))
    top_ids = np.lib.format.open_memmap(work / "top_ids.npy", mode=mode, dtype=np.int32, shape=(len(tokens), TOP))
    top_probs = np.lib.format.open_memmap(work / "top_probs.npy", mode=mode, dtype=np.float16,
                                          shape=(len(tokens), TOP))
    order = np.argsort(lengths, kind="stable")
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    start = time.perf_counter()
    for number, batch in enumerate(batches):
        if number < done:
            continue
        width = int(lengths[batch].max())
        ids = torch.zeros(len(batch), width, dtype=torch.long)  # right padding: causal rows never see it
        for row, seq in enumerate(batch):
            span = tokens[starts[seq] : starts[seq] + lengths[seq]]
            ids[row, : lengths[seq]] = torch.from_numpy(span.astype(np.int64))
        with torch.inference_mode():
            states = model.model(input_ids=ids).last_hidden_state
            probs = torch.softmax(model.lm_head(states).float(), dim=-1)
            best = probs.topk(TOP, dim=-1)
        for row, seq in enumerate(batch):
            span = slice(int(starts[seq]), int(starts[seq] + lengths[seq]))
            n = int(lengths[seq])
            features[span] = states[row, :n].to(torch.float16).numpy()
            top_ids[span] = best.indices[row, :n].to(torch.int32).numpy()
            top_probs[span] = best.values[row, :n].to(torch.float16).numpy()
        for array in (features, top_ids, top_probs):
            array.flush()
        progress_file.write_text(str(number + 1))
        if (number + 1) % 10 == 0 or number + 1 == len(batches):
            print(f"hidden states: batch {number + 1} of {len(batches)}, {time.perf_counter() - start:.0f} s",
                  flush=True)


def join_data(parts: list[dict[str, np.ndarray]], works: list[Path]
              ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The data files as one (sequences in file order, their `starts` shifted) and their phase-1 arrays, in memory."""
    offsets = np.cumsum([0] + [len(part["tokens"]) for part in parts[:-1]])
    data = {key: np.concatenate([part[key] for part in parts]) for key in parts[0] if key != "starts"}
    data["starts"] = np.concatenate([part["starts"] + offset for part, offset in zip(parts, offsets)])
    features = {name: np.concatenate([np.load(work / f"{name}.npy", mmap_mode="r") for work in works])
                for name in ("features", "top_ids", "top_probs")}
    return data, features


def draft_vocabulary(tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray, train: np.ndarray,
                     vocab_size: int, size: int) -> np.ndarray:
    """The `size` ids most frequent in the training sequences (ties by id), most frequent first."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for seq in train:
        counts += np.bincount(tokens[starts[seq] : starts[seq] + lengths[seq]], minlength=vocab_size)
    return np.lexsort((np.arange(vocab_size), -counts))[:size]


class Batches:
    """Training examples of a set of sequences as padded tensors (position `i` pairs `f_i` with `t_{i+1}`)."""

    def __init__(self, data: dict[str, np.ndarray], features: dict[str, np.ndarray], vocab_index: torch.Tensor
                 ) -> None:
        self.tokens = data["tokens"]
        self.starts = data["starts"]
        self.lengths = data["lengths"]
        self.features = features["features"]
        self.top_ids = features["top_ids"]
        self.top_probs = features["top_probs"]
        self.vocab_index = vocab_index  # target id -> draft vocabulary index, -1 outside it

    def plan(self, seqs: np.ndarray, max_tokens: int, generator: np.random.Generator | None) -> list[np.ndarray]:
        """Batches of similar length of at most `max_tokens` padded positions (shuffled when `generator` is given)."""
        order = seqs[np.argsort(self.lengths[seqs], kind="stable")]
        batches: list[np.ndarray] = []
        current: list[int] = []
        for seq in order:
            if current and (len(current) + 1) * int(self.lengths[seq]) > max_tokens:
                batches.append(np.asarray(current))
                current = []
            current.append(int(seq))
        if current:
            batches.append(np.asarray(current))
        if generator is not None:
            generator.shuffle(batches)
        return batches

    def tensors(self, batch: np.ndarray) -> dict[str, torch.Tensor]:
        """`next_ids`, `states`, `targets`, `label_ids` (draft-vocabulary indices, -1: none), `label_probs`, `mask`."""
        width = int(self.lengths[batch].max()) - 1
        hidden = self.features.shape[1]
        out = {
            "next_ids": torch.zeros(len(batch), width, dtype=torch.long),
            "states": torch.zeros(len(batch), width, hidden),
            "targets": torch.zeros(len(batch), width, hidden),
            "label_ids": torch.full((len(batch), width, TOP), -1, dtype=torch.long),
            "label_probs": torch.zeros(len(batch), width, TOP),
            "mask": torch.zeros(len(batch), width, dtype=torch.bool),
        }
        for row, seq in enumerate(batch):
            start, n = int(self.starts[seq]), int(self.lengths[seq]) - 1
            feats = torch.from_numpy(np.asarray(self.features[start : start + n + 1], dtype=np.float32))
            out["next_ids"][row, :n] = torch.from_numpy(self.tokens[start + 1 : start + n + 1].astype(np.int64))
            out["states"][row, :n] = feats[:n]
            out["targets"][row, :n] = feats[1:]
            ids = torch.from_numpy(np.asarray(self.top_ids[start + 1 : start + n + 1], dtype=np.int64))
            out["label_ids"][row, :n] = self.vocab_index[ids]
            out["label_probs"][row, :n] = torch.from_numpy(
                np.asarray(self.top_probs[start + 1 : start + n + 1], dtype=np.float32))
            out["mask"][row, :n] = True
        return out


def step_losses(predicted: torch.Tensor, lm_rows: torch.Tensor, batch: dict[str, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SmoothL1 to the target's states, soft cross-entropy to its top-8 distribution (over the draft vocabulary),
    and how many positions' top draft token equals the target's top token."""
    mask = batch["mask"]
    reg = F.smooth_l1_loss(predicted[mask], batch["targets"][mask])
    logq = torch.log_softmax(predicted[mask] @ lm_rows.T, dim=-1)
    ids = batch["label_ids"][mask]
    probs = batch["label_probs"][mask] * (ids >= 0)
    probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-6)
    cls = -(probs * logq.gather(-1, ids.clamp_min(0))).sum(-1).mean()
    agree = (logq.argmax(-1) == ids[:, 0]).sum()
    return reg, cls, agree


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, nargs="+", default=[Path("data/draft_head/smollm2_selfdistill.npz"),
                                                                Path("data/draft_head/smollm2_selfdistill_open.npz")])
    parser.add_argument("--output", type=Path, default=Path("decodekit/models/heads/smollm2-135m-instruct.safetensors"))
    parser.add_argument("--work-dir", type=Path, default=Path(".cache/draft_head"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--cls-weight", type=float, default=0.5)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--features-batch", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-after-features", action="store_true")
    args = parser.parse_args()

    from decodekit.models.draft_head import DraftHead, DraftHeadConfig, save_head
    from decodekit.models.loader import load_model

    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model = load_model(args.model, dtype="float32", device="cpu").model
    parts = []
    for path in args.data:  # phase 1 per data file, each in its own folder
        part = dict(np.load(path))
        hidden_states(model, part, args.work_dir / path.stem, args.features_batch)
        parts.append(part)
    if args.stop_after_features:
        return
    data, features = join_data(parts, [args.work_dir / path.stem for path in args.data])

    seqs = np.arange(len(data["starts"]))
    held_out, train = seqs[seqs % 20 == 0], seqs[seqs % 20 != 0]
    file_of = np.concatenate([np.full(len(part["starts"]), n) for n, part in enumerate(parts)])
    held_outs = {path.stem: held_out[file_of[held_out] == n] for n, path in enumerate(args.data)}
    vocab = draft_vocabulary(data["tokens"], data["starts"], data["lengths"], train, model.config.vocab_size,
                             args.draft_vocab)
    vocab_index = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    vocab_index[torch.from_numpy(vocab)] = torch.arange(len(vocab))
    embedding = model.get_input_embeddings().weight.detach()
    lm_rows = model.get_output_embeddings().weight.detach()[torch.from_numpy(vocab)].contiguous()

    torch.manual_seed(args.seed)
    config = DraftHeadConfig.for_target(model.config, args.draft_vocab, target=args.model)
    head = DraftHead(config)
    head.draft_vocab.copy_(torch.from_numpy(vocab))
    source = Batches(data, features, vocab_index)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    steps_per_epoch = len(source.plan(train, args.batch_tokens, None))
    total_steps = steps_per_epoch * args.epochs
    warmup = max(1, total_steps // 20)

    def lr_at(step: int) -> float:  # linear warm-up, cosine down to a tenth
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(1, total_steps - warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    checkpoint = args.work_dir / "checkpoint.pt"
    first_epoch, history = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        first_epoch, history = state["epoch"], state["history"]
        print(f"resuming after epoch {first_epoch}", flush=True)

    def evaluate(held_out: np.ndarray) -> tuple[float, float]:
        head.eval()
        agree, positions = [0, 0], 0
        with torch.no_grad():
            for batch_seqs in source.plan(held_out, args.batch_tokens, None):
                batch = source.tensors(batch_seqs)
                embeds = embedding[batch["next_ids"]]
                first, kv = head(embeds, batch["states"])
                second = head.forward_second(embeds, batch["states"], first, kv)
                for n, predicted in enumerate((first, second)):
                    agree[n] += int(step_losses(predicted, lm_rows, batch)[2])
                positions += int(batch["mask"].sum())
        head.train()
        return agree[0] / positions, agree[1] / positions

    start = time.perf_counter()
    step = first_epoch * steps_per_epoch
    for epoch in range(first_epoch, args.epochs):
        plan = source.plan(train, args.batch_tokens, np.random.default_rng(args.seed + epoch))
        head.train()
        sums = np.zeros(4)
        for number, batch_seqs in enumerate(plan):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            batch = source.tensors(batch_seqs)
            embeds = embedding[batch["next_ids"]]
            first, kv = head(embeds, batch["states"])
            second = head.forward_second(embeds, batch["states"], first, kv)
            reg1, cls1, _ = step_losses(first, lm_rows, batch)
            reg2, cls2, _ = step_losses(second, lm_rows, batch)
            loss = reg1 + args.cls_weight * cls1 + reg2 + args.cls_weight * cls2
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            step += 1
            sums += [float(reg1), float(cls1), float(reg2), float(cls2)]
            if (number + 1) % 20 == 0:
                mean = sums / (number + 1)
                print(f"epoch {epoch + 1} batch {number + 1}/{len(plan)}: reg {mean[0]:.4f}/{mean[2]:.4f} "
                      f"cls {mean[1]:.3f}/{mean[3]:.3f}, {time.perf_counter() - start:.0f} s", flush=True)
        record: dict[str, object] = {"epoch": epoch + 1, "seconds": round(time.perf_counter() - start)}
        for name, seqs_of_file in held_outs.items():
            first_agree, second_agree = evaluate(seqs_of_file)
            record[f"{name}_top1"] = [round(first_agree, 4), round(second_agree, 4)]
        history.append(record)
        print(json.dumps(history[-1]), flush=True)
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                    "history": history}, checkpoint)
    save_head(head, args.output, {"history": json.dumps(history), "data": str(args.data),
                                  "arguments": json.dumps({k: str(v) for k, v in vars(args).items()})})
    print(f"wrote {args.output}", flush=True)


if __name__ == "__main__":
    main()
