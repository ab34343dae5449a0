"""Static-shape data: padding and packing into fixed rows, batches always [batch, max_length], packed loss == unpacked."""

import pytest
import torch

from staticformers import AutoConfig, AutoModelForCausalLM
from staticformers.training.data import (
    EMPTY_ROW,
    IGNORE_INDEX,
    StaticBatchSampler,
    build_rows,
    pack_rows,
    pad_rows,
    tokenize_dataset,
)
import tolerances as tol


pytestmark = pytest.mark.usefixtures("one_thread")


def docs_of(lengths, seed=0, vocab=100):
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, vocab, (n,), generator=g).tolist()} for n in lengths]


def test_padding_rows_labels_and_long_documents():
    ds = docs_of([3, 8, 11])
    table = build_rows(ds, None, max_length=8, packing=False)
    assert tuple(table.input_ids.shape) == (4, 8) and table.position_ids is None  # 11 tokens split into 8 + 3
    assert table.labels[0].tolist()[:3] == ds[0]["input_ids"] and table.labels[0, 3:].eq(IGNORE_INDEX).all()
    assert table.labels[2].tolist() == ds[2]["input_ids"][:8] and table.labels[3, :3].tolist() == ds[2]["input_ids"][8:]
    assert table.real_tokens == 22 and table.padding_waste == pytest.approx(1 - 22 / 32)
    cut = build_rows(ds, None, max_length=8, packing=False, long_documents="truncate")
    assert cut.num_rows == 3 and cut.real_tokens == 19


def test_given_labels_are_kept():
    ds = [{"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}]
    table = build_rows(ds, None, max_length=6, packing=False)
    assert table.labels[0].tolist() == [-100, -100, 7, 8, -100, -100]
    with pytest.raises(ValueError, match="same length"):
        build_rows([{"input_ids": [1, 2], "labels": [1]}], None, 4, False)


def test_bfd_packing_keeps_documents_whole_and_restarts_positions():
    lengths = [5, 3, 7, 2, 6, 1, 4]
    table = build_rows(docs_of(lengths), None, max_length=8, packing=True)
    assert table.num_rows == 4 and table.real_tokens == sum(lengths)  # 28 tokens in 4 rows of 8
    for r in range(table.num_rows):
        pos = table.position_ids[r]
        starts = [0] + [i for i in range(1, 8) if pos[i] != pos[i - 1] + 1]
        for s in starts:  # every document (and the padding tail) starts at position 0 with no label
            assert pos[s] == 0 and table.labels[r, s] == IGNORE_INDEX
    wrapped = build_rows(docs_of(lengths), None, max_length=8, packing=True, packing_strategy="wrapped")
    assert wrapped.num_rows == 4 and wrapped.padding_waste == pytest.approx(4 / 32)


def test_text_with_a_tokenizers_tokenizer_and_columns():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2, "c": 3}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    docs = tokenize_dataset({"text": ["a b c", "c c"]}, tok)
    assert [d.input_ids for d in docs] == [[1, 2, 3], [3, 3]]
    assert [d.input_ids for d in tokenize_dataset(["a b"], tok)] == [[1, 2]]
    with pytest.raises(ValueError, match="processing_class"):
        tokenize_dataset([{"text": "a"}], None)
    with pytest.raises(ValueError, match="none of 'input_ids', 'text', 'messages' or 'prompt'/'completion'"):
        tokenize_dataset([{"ids": [1]}], None)


def test_staticformers_tokenizer_appends_eos(tmp_path):
    from staticformers import AutoTokenizer
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "<eos>": 1, "x": 2, "y": 3}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<eos>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "<eos>", "pad_token": "<eos>"}')
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    table = build_rows([{"text": "x y"}, {"text": "y"}], tok, max_length=4, packing=False)
    assert table.input_ids.tolist() == [[2, 3, 1, 1], [3, 1, 1, 1]]
    assert table.labels.tolist() == [[2, 3, 1, -100], [3, 1, -100, -100]]


def test_torch_dataset_is_accepted():
    class DS(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return {"input_ids": torch.arange(1, 4 + i)}

    assert build_rows(DS(), None, 4, False).input_ids.tolist() == [[1, 2, 3, 0], [1, 2, 3, 4]]


def test_sampler_always_full_batches():
    s = StaticBatchSampler(10, 4, shuffle=True, seed=3, drop_last=True)
    batches = list(s)
    assert len(s) == 2 and all(len(b) == 4 for b in batches) and len(set(sum(batches, []))) == 8
    s.set_epoch(1)
    assert list(s) != batches  # a new order each epoch, the same for the same epoch
    s.set_epoch(0)
    assert list(s) == batches
    keep = list(StaticBatchSampler(10, 4, shuffle=False, drop_last=False))
    assert keep[-1] == [8, 9, EMPTY_ROW, EMPTY_ROW]
    table = pad_rows(tokenize_dataset(docs_of([3] * 10)), 5)
    b = table.batch(keep[-1])
    assert tuple(b["input_ids"].shape) == (4, 5) and b["labels"][2:].eq(IGNORE_INDEX).all()
    ranks = [list(StaticBatchSampler(16, 4, seed=0, rank=r, world_size=2)) for r in range(2)]
    assert len(ranks[0]) == 2 and not set(sum(ranks[0], [])) & set(sum(ranks[1], []))


def tiny_model():
    cfg = AutoConfig.for_model(
        "qwen3",
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    )
    return AutoModelForCausalLM.from_config(cfg, seed=0).eval()


def test_packed_loss_equals_unpacked_loss():
    model = tiny_model()
    lengths = [5, 9, 3, 12, 7, 4, 8]
    ds = docs_of(lengths, seed=1)
    packed = pack_rows(tokenize_dataset(ds), 16)
    padded = pad_rows(tokenize_dataset(ds), 16)
    assert packed.num_rows < padded.num_rows and packed.padding_waste < padded.padding_waste
    with torch.no_grad():

        def summed(table, positions):
            b = table.batch(list(range(table.num_rows)))
            n = int((b["labels"][:, 1:] != IGNORE_INDEX).sum())
            out = model(
                input_ids=b["input_ids"],
                labels=b["labels"],
                position_ids=b.get("position_ids") if positions else None,
                num_items_in_batch=torch.tensor(n),
            )
            return out.loss, n

        lp, np_ = summed(packed, True)
        lu, nu = summed(padded, False)
    assert np_ == nu == sum(n - 1 for n in lengths)
    assert float(lp) == pytest.approx(float(lu), rel=tol.FP32_REORDERED)  # losses near ln(vocab): relative
