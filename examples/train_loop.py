"""Your own training loop on hetcc's per-rank API, under torchrun (every rank runs this same script):

torchrun --standalone --nproc-per-node 3 examples/train_loop.py build/lm build/tokens 100
"""

import sys

import torch

from hetcc.train import LRSchedule, PipelineRank, TokenDataset, param_groups

build, tokens, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rank = PipelineRank.join(build)  # this process's stage (or replica), on its planned device
optimizer = torch.optim.AdamW(param_groups(rank.named_parameters(), weight_decay=0.1), lr=3e-3)
scheduler = LRSchedule(warmup_steps=10, decay="cosine", total_steps=steps).scheduler(optimizer)
for step, batch in zip(range(steps), rank.data(TokenDataset(tokens, rank.seq_len))):
    out = rank.step(batch)  # forward + backward of this rank's microbatches; full-batch gradients
    norm = rank.clip_grad_norm_(1.0)  # the global norm over every stage and replica
    optimizer.step()
    scheduler.step()
    if rank.reports:  # the last stage's first replica has the loss
        print(f"step {step} loss {out.mean_loss:.6f} grad_norm {norm:.6f}", flush=True)
val = rank.evaluate(next(rank.data(TokenDataset(tokens, rank.seq_len, split="val"))))
if rank.reports:
    print(f"val loss {val.mean_loss:.6f}", flush=True)
rank.save(f"{build}/my-checkpoints", optimizer)  # weights, optimizer, RNG: load() continues from it
rank.close()
