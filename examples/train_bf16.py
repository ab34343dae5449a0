"""The seed's first TrainingArguments snippet, runnable: bf16 training on the device found by itself.

    from transformers import TrainingArguments          # the seed
    from staticformers import TrainingArguments         # here: only the import changes

    training_args = TrainingArguments(output_dir="./outputs", bf16=True)

On Trainium the device is `neuron` (every generation does bf16); here it is whatever
`device_map="auto"` finds. A tiny Qwen3-shaped model learns to count for a few steps.
"""

import sys

from staticformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

training_args = TrainingArguments(
    output_dir="./outputs",
    bf16=True,
)

# -- a tiny model and a counting task, so the snippet runs anywhere in seconds -------------------
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
training_args.max_steps, training_args.max_length, training_args.per_device_train_batch_size = steps, 32, 8
training_args.learning_rate, training_args.logging_steps, training_args.save_strategy = 3e-3, 10, "no"
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
data = [{"input_ids": [(s + i) % 63 + 1 for i in range(8 + s % 20)]} for s in range(128)]

print(f"device {training_args.device}, bf16 {training_args.bf16}")
trainer = Trainer(model=model, args=training_args, train_dataset=data)
out = trainer.train()
print(f"trained {out.global_step} steps, loss {out.training_loss:.3f}")
