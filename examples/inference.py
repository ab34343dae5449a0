"""The seed's inference snippet (AWS Trainium page of the Transformers docs), with only the import
changed and the model pointed at a local checkpoint.

The snippet loads Qwen3-0.6B; nothing can be downloaded here, so the example first builds a tiny
Qwen3-shaped checkpoint with a small trained tokenizer, trained for a few seconds on three sentences
(once, under $STATICFORMERS_EXAMPLE_DIR or a temporary folder), so that what it prints is text, not
the stray bytes of random weights (half characters). Pass a real checkpoint folder or Hub id as the
first argument to use it.
On Trainium, device_map="auto" finds Neuron and generate() compiles prefill and decode for it.
"""

import json
import os
import sys
import tempfile

import torch

from staticformers import AutoModelForCausalLM, AutoTokenizer  # the only line changed from the seed

DEFAULT = os.environ.get(
    "STATICFORMERS_EXAMPLE_DIR", os.path.join(tempfile.gettempdir(), "staticformers-example-qwen3")
)
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
CORPUS = [
    "The French Bread Law states that a baguette must be made on the premises where it is sold.",
    "Trainium compiles one graph per input shape, so static shapes avoid recompilation.",
    "Keep the growing tensors on the host and send fixed-shape inputs to the device.",
] * 20


def build_checkpoint(folder: str, steps: int = 30) -> str:
    """A tiny Qwen3 model trained `steps` steps on CORPUS and its byte-level BPE tokenizer, saved in
    Hugging Face format."""
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    config = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": tok.get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "tie_word_embeddings": True,
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
    }
    model = AutoModelForCausalLM.from_config(config, seed=0)
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 1024,
            },
            f,
            indent=2,
        )
    if steps:
        from staticformers import Trainer, TrainingArguments

        args = TrainingArguments(
            output_dir=os.path.join(folder, "run"),
            max_length=32,
            per_device_train_batch_size=8,
            max_steps=steps,
            learning_rate=1e-2,
            warmup_steps=5,
            lr_scheduler_type="cosine",
            save_strategy="no",
            logging_steps=steps,
            disable_tqdm=True,
            use_cpu=True,
            seed=0,
        )
        Trainer(
            model=model,
            args=args,
            train_dataset=[{"text": t} for t in CORPUS],
            processing_class=AutoTokenizer.from_pretrained(folder),
        ).train()
    model.save_pretrained(folder)
    return folder


def main(model_id: str) -> str:
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(
        model_id,
        dtype=torch.bfloat16,
        device_map="auto",  # finds Neuron on Trainium; "neuron" works too
    )
    inputs = tokenizer("The French Bread Law states", return_tensors="pt")  # stays on the CPU
    outputs = model.generate(
        **inputs,
        do_sample=False,
        max_new_tokens=50,
        cache_implementation="static",
    )
    text = tokenizer.decode(outputs[0], skip_special_tokens=True)
    print(text)
    return text


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else build_checkpoint(DEFAULT))
