"""The seed's distributed snippet, runnable under torchrun: tensor parallel x FSDP2 at load time.

    from staticformers import AutoModelForCausalLM, DistributedConfig, Trainer, TrainingArguments

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))
    Trainer(model=model, args=TrainingArguments(output_dir="out", bf16=True), train_dataset=ds).train()

Run it on one machine with 4 processes (CPU: gloo; GPUs: nccl; Trainium: neuron):

    torchrun --nproc_per_node=4 examples/distributed_train.py [MODEL_PATH] [STEPS]

Across two nodes (run the same line on each, NODE_RANK 0 and 1, MASTER = node 0's address):

    torchrun --nnodes=2 --nproc_per_node=4 --node_rank=$NODE_RANK \
             --rdzv_backend=c10d --rdzv_endpoint=$MASTER:29500 --rdzv_id=job1 \
             examples/distributed_train.py MODEL_PATH

Without MODEL_PATH a tiny random Qwen3 is written to ./outputs/tiny-qwen3 (rank 0, the others wait)
so the script runs offline in seconds; the layout comes from SF_TP (default 2) and the world size,
the number of steps from STEPS, else $STATICFORMERS_EXAMPLE_STEPS, else 20.
"""

import os
import sys

import torch
import torch.distributed as dist

from staticformers import AutoConfig, AutoModelForCausalLM, DistributedConfig, Trainer, TrainingArguments
from staticformers.distributed import shutdown
from staticformers.distributed.mesh import init_distributed, local_device


def tiny_checkpoint(path: str) -> str:
    """Rank 0 writes a tiny Qwen3 checkpoint (4 heads, 4 KV heads: tp_size up to 4); every rank waits."""
    init_distributed(local_device())
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        config = AutoConfig.for_model(
            "qwen3",
            vocab_size=64,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            head_dim=16,
            tie_word_embeddings=True,
        )
        AutoModelForCausalLM.from_config(config, seed=0).save_pretrained(path)
    dist.barrier()
    return path


path = sys.argv[1] if len(sys.argv) > 1 else tiny_checkpoint("./outputs/tiny-qwen3")
steps = int(sys.argv[2]) if len(sys.argv) > 2 else int(os.environ.get("STATICFORMERS_EXAMPLE_STEPS", "20"))
world = int(os.environ.get("WORLD_SIZE", "1"))
tp = min(int(os.environ.get("SF_TP", "2")), world)

# -- the seed's snippet ----------------------------------------------------------------------------
model = AutoModelForCausalLM.from_pretrained(
    path, dtype=torch.bfloat16, distributed_config=DistributedConfig(tp_size=tp, fsdp_size=world // tp)
)
ds = [{"input_ids": [(s + i) % 63 + 1 for i in range(8 + s % 20)]} for s in range(256)]  # learn to count
args = TrainingArguments(
    output_dir="./outputs/distributed",
    bf16=True,
    max_steps=steps,
    max_length=32,
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    logging_steps=5,
    save_strategy="no",
)
trainer = Trainer(model=model, args=args, train_dataset=ds)
out = trainer.train()
# ---------------------------------------------------------------------------------------------------

trainer.save_model("./outputs/distributed/final")  # every rank calls it; rank 0 writes one HF checkpoint
if dist.get_rank() == 0:
    dims = model.parallel_dims
    print(
        f"{world} ranks as dp_replicate x fsdp x tp = {dims.mesh.shape}: {out.global_step} steps, "
        f"loss {out.training_loss:.3f}; saved ./outputs/distributed/final"
    )
del trainer, model
shutdown()  # after the model is gone: collect, wait for every rank, destroy the process group
