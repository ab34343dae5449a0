"""`staticformers train PATH --data corpus.jsonl --output-dir out`: the Trainer from the shell.

PATH is a checkpoint folder (fine-tune it), or a `config.json` / a folder holding only one (train
from scratch, random init with `--seed`). Data is a `.txt` file (documents separated by blank lines;
`--txt-documents line` for one per line, `file` for one per file), a `.jsonl` file (objects with
`text`, `input_ids`, `messages` (conversations, optional `tools`) or `prompt`/`completion`), or a
folder of such files (a `datasets` `save_to_disk` folder when the `datasets` package is installed).
Text and conversations are tokenised with `--tokenizer` or the tokenizer in PATH (its chat template,
or `--chat-template FILE`); `--assistant-only-loss` puts the loss on the assistant's tokens only.
The trained model (and tokenizer) is saved in Hugging Face format to `--output-dir`. With `--lora-r`
only a LoRA adapter trains (PEFT's LoraConfig: `--lora-alpha`, `--lora-dropout`, `--lora-target`) and
`--output-dir` receives the adapter (adapter_config.json + adapter_model.safetensors), as peft saves it.
`--learning-rate` defaults to 5e-5 (transformers'), or to 2e-4 with `--lora-r` (the LoRA rate of TRL's
and peft's examples).
"""

from __future__ import annotations

import json
import os

from .options import add_threads

HELP = "train or fine-tune a causal LM on text or conversations with fixed shapes (padding or packing)"
DEFAULT_MAX_LENGTH = 512


FULL_LEARNING_RATE = 5e-5  # TrainingArguments' default, transformers'
LORA_LEARNING_RATE = 2e-4  # TRL's SFT + peft examples (SFTConfig(learning_rate=2e-4) for LoRA)


def add_arguments(parser) -> None:
    parser.add_argument(
        "path", help="checkpoint folder to fine-tune, or a config.json (or folder with one) to train from scratch"
    )
    parser.add_argument("--data", required=True, help=".txt, .jsonl, or a folder of them")
    parser.add_argument("--eval-data", default=None, help="evaluation data, same formats")
    parser.add_argument("--output-dir", default="outputs", help="where checkpoints, metrics and the final model go")
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: PATH)")
    parser.add_argument(
        "--txt-documents",
        choices=("paragraph", "line", "file"),
        default="paragraph",
        help="how .txt files split into documents (default: blank-line separated paragraphs)",
    )
    parser.add_argument(
        "--max-length",
        type=int,
        default=None,
        help="tokens per row, every batch being [batch size, max length] (default: 512, or the "
        "model's positions when fewer); more than the model's positions is refused",
    )
    parser.add_argument("--packing", action="store_true", help="pack documents into full rows (default: pad each)")
    parser.add_argument(
        "--assistant-only-loss",
        action="store_true",
        help="loss only on the assistant's tokens of `messages` conversations (the chat template's "
        "{%% generation %%} blocks)",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a .jinja chat template (or a tokenizer folder) replacing the tokenizer's (chat_template_path)",
    )
    parser.add_argument("--batch-size", type=int, default=8, help="per_device_train_batch_size")
    parser.add_argument("--eval-batch-size", type=int, default=8, help="per_device_eval_batch_size")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="AdamW's peak learning rate (default: 5e-5, transformers'; 2e-4 with --lora-r, the rate "
        "of TRL's and peft's LoRA examples, about 10x the full fine-tuning one)",
    )
    parser.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay (none on norms and biases)")
    parser.add_argument(
        "--lr-scheduler-type", default="linear", help="linear, cosine, constant or constant_with_warmup"
    )
    parser.add_argument(
        "--warmup-steps", type=float, default=0, help="linear warmup steps (below 1: a fraction of the run)"
    )
    parser.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="clip gradients to this global norm (0: no clipping)"
    )
    parser.add_argument("--epochs", type=float, default=3.0, help="num_train_epochs")
    parser.add_argument("--max-steps", type=int, default=-1, help="optimizer steps (overrides --epochs when positive)")
    parser.add_argument(
        "--logging-steps", type=float, default=10, help="log every N steps (below 1: a fraction of the run)"
    )
    parser.add_argument(
        "--eval-steps", type=float, default=None, help="evaluate every N steps (default: --logging-steps)"
    )
    parser.add_argument("--save-steps", type=float, default=500, help="write a checkpoint every N steps")
    parser.add_argument("--save-total-limit", type=int, default=None, help="keep only the last N checkpoints")
    parser.add_argument("--no-save", action="store_true", help='save_strategy="no" (only the final model is written)')
    parser.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 weights and activations with fp32 master weights (refused where the device lacks bf16)",
    )
    parser.add_argument("--compile", action="store_true", help="torch_compile=True (backend: the device's)")
    parser.add_argument("--backend", default=None, help="torch_compile_backend (implies --compile)")
    parser.add_argument(
        "--gradient-checkpointing", action="store_true", help="recompute activations in backward to save memory"
    )
    parser.add_argument("--use-cpu", action="store_true", help="train on the CPU even when an accelerator is here")
    add_threads(parser)
    parser.add_argument(
        "--report-to",
        default="none",
        help="none, tensorboard or all (metrics.jsonl and loss_curve.png are always written)",
    )
    parser.add_argument(
        "--seed", type=int, default=42, help="seed for the initial weights (from scratch) and the data order"
    )
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        help="resume from the last checkpoint in --output-dir, or from the given one",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--lora-r",
        type=int,
        default=None,
        help="train a LoRA adapter of this rank instead of the whole model (the base stays frozen)",
    )
    parser.add_argument("--lora-alpha", type=float, default=None, help="LoRA's alpha (scale alpha / r; default 2 x r)")
    parser.add_argument("--lora-dropout", type=float, default=0.0, help="dropout on the adapter's input (default 0)")
    parser.add_argument(
        "--lora-target",
        default=None,
        help="comma-separated modules to adapt, e.g. q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,"
        "down_proj, or all-linear (default: q_proj,v_proj, PEFT's)",
    )
    parser.add_argument("--use-rslora", action="store_true", help="rank-stabilised LoRA: scale alpha / sqrt(r)")


def lora_config(args):
    """The LoraConfig the --lora-* flags describe, or None without --lora-r (the others alone are refused)."""
    from ..adapters.lora_config import ALL_LINEAR, LoraConfig

    if args.lora_r is None:
        given = [
            f
            for f, v in (
                ("--lora-alpha", args.lora_alpha),
                ("--lora-target", args.lora_target),
                ("--use-rslora", args.use_rslora),
                ("--lora-dropout", args.lora_dropout or None),
            )
            if v is not None and v is not False
        ]
        if given:
            raise ValueError(f"{given[0]} sets up a LoRA adapter, which needs its rank: add --lora-r (e.g. 16).")
        return None
    target = None
    if args.lora_target is not None:
        names = [t.strip() for t in args.lora_target.split(",") if t.strip()]
        if not names:
            raise ValueError(
                f"--lora-target {args.lora_target!r} names no module: pass e.g. q_proj,v_proj or all-linear."
            )
        target = ALL_LINEAR if names == [ALL_LINEAR] else names
    alpha = args.lora_alpha if args.lora_alpha is not None else 2 * args.lora_r
    return LoraConfig(
        r=args.lora_r,
        lora_alpha=alpha,
        lora_dropout=args.lora_dropout,
        target_modules=target,
        use_rslora=args.use_rslora,
    )


class Rows(list):
    """Examples read from files, each with where it came from (`origins[i]`: "FILE line N", "FILE paragraph N")."""

    def __init__(self, rows=(), origins=()):
        super().__init__(rows)
        self.origins = list(origins)


def read_documents(path: str, txt_documents: str = "paragraph") -> list:
    """Examples (strings or dicts) from a .txt/.jsonl file or a folder of them (a `Rows`, but for a `datasets`
    folder)."""
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "dataset_info.json")) or os.path.exists(os.path.join(path, "state.json")):
            try:
                import datasets
            except ImportError:
                raise ValueError(
                    f"{path} is a `datasets` folder but the datasets package is not installed: "
                    f"pip install datasets, or pass .txt/.jsonl files."
                ) from None
            return datasets.load_from_disk(path)
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".txt", ".jsonl")))
        if not files:
            raise ValueError(f"{path} holds no .txt or .jsonl files: put the corpus there or pass a file.")
        out = Rows()
        for f in files:
            rows = read_documents(f, txt_documents)
            out.extend(rows)
            out.origins.extend(rows.origins)
        return out
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Data {path} does not exist: pass a .txt or .jsonl file or a folder of them.")
    if path.endswith(".jsonl"):
        out = Rows()
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append(json.loads(line))
                    except json.JSONDecodeError as err:
                        raise ValueError(f"{path} line {n} is not JSON ({err.msg}): fix or remove that line.") from None
                    out.origins.append(f"{path} line {n}")
        return out
    if path.endswith(".txt"):
        with open(path, encoding="utf-8") as f:
            text = f.read()
        if txt_documents == "file":
            return Rows([text], [path]) if text.strip() else Rows()
        if txt_documents == "line":
            lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
            return Rows([line for _, line in lines], [f"{path} line {n}" for n, _ in lines])
        paragraphs = [p.strip() for p in text.split("\n\n") if p.strip()]
        return Rows(paragraphs, [f"{path} paragraph {k}" for k in range(1, len(paragraphs) + 1)])
    raise ValueError(f"Data {path} is neither .txt nor .jsonl: convert it, or pass a folder of such files.")


def has_text(docs) -> bool:
    """Whether a dataset (as read_documents returns it) holds text that needs a tokenizer."""
    first = next(iter(docs), None)
    return isinstance(first, str) or (isinstance(first, dict) and "text" in first and "input_ids" not in first)


def load_model(path: str, seed: int):
    from ..models.model_config import ModelConfig
    from ..api.auto import AutoModelForCausalLM

    config_file = path if path.endswith(".json") else os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"{path} has no config.json: pass a checkpoint folder or a config.json to train from scratch."
        )
    folder = os.path.dirname(config_file)
    has_weights = any(
        n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in os.listdir(folder or ".")
    )
    if has_weights and not path.endswith(".json"):
        return AutoModelForCausalLM.from_pretrained(folder), folder
    return AutoModelForCausalLM.from_config(ModelConfig.from_json_file(config_file), seed=seed), folder


def load_tokenizer(folder: str):
    if not folder or not os.path.isfile(os.path.join(folder, "tokenizer.json")):
        return None
    try:
        from ..tokenization.tokenizer import AutoTokenizer
    except ImportError:  # pragma: no cover - the tokenizer module is part of the package
        from tokenizers import Tokenizer

        return Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    return AutoTokenizer.from_pretrained(folder)


def where(err, datasets: dict) -> str:
    """An ExampleError's sentence, starting with the flag and the file line its example came from."""
    for flag, rows in datasets.items():
        if rows is not None and err.dataset is rows and err.index < len(getattr(rows, "origins", ())):
            message = str(err)
            lead = f"Example {err.index} "
            if message.startswith(lead):
                message = "this example " + message[len(lead) :]
            return f"{flag} {rows.origins[err.index]}: {message}"
    return str(err)


def run(args) -> int:
    from ..training.arguments import TrainingArguments
    from ..training.documents import ExampleError
    from ..training.trainer import Trainer

    lora = lora_config(args)  # refused before anything loads
    learning_rate = (
        args.learning_rate
        if args.learning_rate is not None
        else (LORA_LEARNING_RATE if lora is not None else FULL_LEARNING_RATE)
    )
    model, folder = load_model(args.path, args.seed)
    if lora is not None:
        model.add_adapter(lora)
    tokenizer = load_tokenizer(args.tokenizer or folder)
    train = read_documents(args.data, args.txt_documents)
    evaluation = read_documents(args.eval_data, args.txt_documents) if args.eval_data else None
    if tokenizer is None:
        if args.tokenizer:
            raise ValueError(f"--tokenizer {args.tokenizer} has no tokenizer.json: pass a tokenizer folder.")
        for name, docs in (("--data", train), ("--eval-data", evaluation or [])):
            if has_text(docs):
                raise ValueError(
                    f"{name} {getattr(args, name[2:].replace('-', '_'))} holds text but {folder or args.path} "
                    f"has no tokenizer.json: pass --tokenizer FOLDER (a folder with tokenizer.json)."
                )
    targs = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=learning_rate,
        weight_decay=args.weight_decay,
        lr_scheduler_type=args.lr_scheduler_type,
        warmup_steps=args.warmup_steps,
        max_grad_norm=args.max_grad_norm,
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if evaluation is not None else "no",
        eval_steps=args.eval_steps,
        save_strategy="no" if args.no_save else "steps",
        save_steps=args.save_steps,
        save_total_limit=args.save_total_limit,
        bf16=args.bf16,
        torch_compile=args.compile or args.backend is not None,
        torch_compile_backend=args.backend,
        gradient_checkpointing=args.gradient_checkpointing,
        use_cpu=args.use_cpu,
        report_to=args.report_to,
        seed=args.seed,
        max_length=args.max_length or min(DEFAULT_MAX_LENGTH, model.config.max_position_embeddings),
        packing=args.packing,
        disable_tqdm=args.quiet,
        assistant_only_loss=args.assistant_only_loss,
        chat_template_path=args.chat_template,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=train, eval_dataset=evaluation, processing_class=tokenizer)
    try:  # every row of both sets is read before the first step (the Trainer keeps the rows it built)
        trainer.get_train_rows()
        if evaluation is not None:
            trainer.get_eval_rows()
    except ExampleError as err:  # which file and line, not only which example
        raise ValueError(where(err, {"--data": train, "--eval-data": evaluation})) from None
    out = trainer.train(resume_from_checkpoint=args.resume)
    trainer.save_model(args.output_dir)
    summary = {
        "output_dir": args.output_dir,
        "global_step": out.global_step,
        "train_loss": round(out.training_loss, 6),
        "learning_rate": learning_rate,
        **(
            {
                "adapter": {
                    "r": lora.r,
                    "lora_alpha": lora.lora_alpha,
                    "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
                }
            }
            if lora is not None
            else {}
        ),
        "device": str(targs.device),
        **trainer.compile_stats(),
        "padding_waste": round(out.metrics["train_padding_waste"], 4),
        "loss_token_share": round(out.metrics["train_loss_token_share"], 4),
    }
    if evaluation is not None:
        summary.update({k: v for k, v in trainer.evaluate().items() if k in ("eval_loss", "eval_perplexity")})
    print(json.dumps(summary))
    return 0
