"""The seed's second TrainingArguments snippet, runnable: torch.compile with the device's backend.

    from staticformers import TrainingArguments

    training_args = TrainingArguments(output_dir="./outputs", bf16=True, torch_compile=True)

`torch_compile_backend` is set by itself: `"neuron"` on Trainium, `"inductor"` elsewhere. Forward
and loss compile as two graphs, one decoder layer that every layer reuses and the head with the loss
(backward through AOTAutograd, the optimizer eager); batches are fixed-shape
`[per_device_train_batch_size, max_length]` (padded or packed, the last ragged batch dropped), so the
whole run compiles exactly those two training graphs whatever the document lengths.
"""

import sys

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

training_args = TrainingArguments(
    output_dir="./outputs",
    bf16=True,
    torch_compile=True,
)

# -- a tiny model and documents of every length from 3 to 60 tokens, packed into rows of 64 ------
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
training_args.max_steps, training_args.max_length, training_args.packing = steps, 64, True
training_args.per_device_train_batch_size, training_args.learning_rate = 4, 3e-3
training_args.logging_steps, training_args.save_strategy = 5, "no"
config = AutoConfig.for_model(
    "qwen3",
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)
model = AutoModelForCausalLM.from_config(config, seed=0)
data = [{"input_ids": [(s + i) % 63 + 1 for i in range(3 + s % 58)]} for s in range(200)]

print(f"device {training_args.device}, backend {training_args.torch_compile_backend}")
trainer = Trainer(model=model, args=training_args, train_dataset=data)
out = trainer.train()
stats = trainer.compile_stats()
print(f"trained {out.global_step} steps, loss {out.training_loss:.3f}, training graphs {stats['train_graphs']}")
