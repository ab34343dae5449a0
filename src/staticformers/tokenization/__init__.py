"""AutoTokenizer on the Rust `tokenizers` library: files, chat templates, assistant masks.

tokenizer.py (transformers' tokenizer API), files.py (tokenizer files on disk and on the Hub),
chat_template.py (Jinja rendering, sandboxed, as transformers renders), gguf_tokenizer.py (a tokenizer rebuilt
from a GGUF file's metadata), assistant_masks.py (which tokens of a
rendered chat are the assistant's).

May import: checkpoints, utils.
"""
