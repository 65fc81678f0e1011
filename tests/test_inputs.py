"""Input forms: HF datasets, chat messages, system prompts, templates, cache locations."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchgen.config import JobSpec
from batchgen.errors import InputError
from batchgen.cache import cache_root
from helpers import prepare_all, read_output, read_rows, write_job
from test_pipeline import cli


def _spec(**input_kw):
    return JobSpec.model_validate({"input": input_kw, "output": {"path": "unused"}})


def test_dataset_from_save_to_disk_and_from_data_files(tmp_path):
    import datasets

    ds = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"id": ["a", "b"], "prompt": ["x", "y"]}),
                               "test": datasets.Dataset.from_dict({"id": ["c"], "prompt": ["z"]})})
    ds.save_to_disk(str(tmp_path / "saved"))
    index, win = read_rows(_spec(dataset={"path": str(tmp_path / "saved"), "split": "test"}, id_column="id").input)
    assert index.ids.to_pylist() == ["c"] and win.prompts == ["z"]
    with pytest.raises(InputError, match="'nope' not in"):
        read_rows(_spec(dataset={"path": str(tmp_path / "saved"), "split": "nope"}).input)
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "d.jsonl").write_text('{"id": "j1", "prompt": "p1"}\n{"id": "j2", "prompt": "p2"}\n')
    index, win = read_rows(_spec(dataset={"path": str(tmp_path / "files")}, id_column="id").input)
    assert index.ids.to_pylist() == ["j1", "j2"] and win.prompts == ["p1", "p2"]


def test_unknown_hub_dataset_fails_offline_with_a_clear_message():
    with pytest.raises(InputError, match="cannot load 'no-such-user/no-such-dataset'.*offline"):
        read_rows(_spec(dataset={"path": "no-such-user/no-such-dataset"}).input)


def test_messages_system_prompt_and_template_choices(tmp_path, smol_tokenizer):
    p = tmp_path / "m.parquet"
    msgs = [[{"role": "user", "content": "Hi there"}],
            [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"}],
            None, [{"role": "user", "content": None}]]
    pq.write_table(pa.table({"id": ["a", "b", "c", "d"], "msgs": msgs}), p)
    spec = _spec(path=str(p), messages_column="msgs", id_column="id", system_prompt="You are a pirate.")
    rows, errors = prepare_all(spec, smol_tokenizer, 8192)
    text = {i: smol_tokenizer.decode(list(r.token_ids)) for i, r in rows.items()}
    assert "You are a pirate." in text[0] and "Hi there" in text[0] and text[0].endswith("<|im_start|>assistant\n")
    assert "Be terse." in text[1] and "pirate" not in text[1], "a row's own system message wins"
    assert "messages are null" in errors[2] and "message 0 needs string role and content" in errors[3]

    q = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["Name a colour."]}), q)
    raw = _spec(path=str(q), id_column="id", chat_template=False, system_prompt="SYS")
    rows, _ = prepare_all(raw, smol_tokenizer, 8192)
    assert smol_tokenizer.decode(list(rows[0].token_ids)) == "SYS\n\nName a colour."
    templ = _spec(path=str(q), id_column="id")
    rows, _ = prepare_all(templ, smol_tokenizer, 8192)
    assert smol_tokenizer.decode(list(rows[0].token_ids)).startswith("<|im_start|>system")


def test_pipeline_runs_a_messages_job(tmp_path, tiny_model_dir):
    p = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "msgs": [[{"role": "user", "content": "Hi"}], []]}), p)
    job = write_job(tmp_path, tiny_model_dir, p, input={"messages_column": "msgs", "prompt_column": None})
    assert cli("run", job).exit_code == 0
    df = read_output(tmp_path / "out").sort("id")
    assert df["error"].to_list() == [None, "column 'msgs': messages are empty"]


def test_cache_root_honours_batchgen_cache_then_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("BATCHGEN_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "batchgen"
    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "bg"))
    assert cache_root() == tmp_path / "bg"


def test_gguf_is_converted_once_into_the_cache(monkeypatch, tmp_path, smol_source):
    """A fresh cache folder gets the config and tokenizer (from the GGUF header), then the weights
    of the dtype asked for, dequantised once; a second resolve reuses both."""
    import shutil

    from batchgen.models.loader import ensure_local, ensure_weights, resolve_model

    monkeypatch.setenv("BATCHGEN_CACHE", str(tmp_path / "cache"))
    src = resolve_model(str(smol_source.gguf_file))
    assert src.folder.parent == tmp_path / "cache" / "gguf" and not src.folder.exists()
    assert ensure_local(src) == src.folder and (src.folder / "config.json").is_file()
    assert not list(src.folder.glob("weights-*")), "the config and tokenizer need no weights"
    # Seed the weights from the session's copy instead of dequantising again.
    shutil.copytree(ensure_weights(smol_source, "float32"), src.folder / "weights-float32")
    index = src.folder / "weights-float32" / "model.safetensors.index.json"
    mtime = index.stat().st_mtime
    assert ensure_weights(resolve_model(str(smol_source.gguf_file)), "float32") == index.parent
    assert index.stat().st_mtime == mtime
    assert src.identity == smol_source.identity and src.identity.startswith("gguf:")


def test_sort_groups_rows_that_share_a_long_prefix():
    from array import array

    from batchgen.job.prepare import length_sorted_prefix_groups

    few_shot = list(range(1000, 1200))
    ids = {0: array("i", [5] * 10), 1: array("i", few_shot + [1] * 50), 2: array("i", [7] * 150),
           3: array("i", few_shot + [2] * 5), 4: array("i", [8] * 400), 5: array("i", few_shot + [3] * 20)}
    order = length_sorted_prefix_groups(list(ids), ids)
    assert order == [0, 2, 3, 5, 1, 4], "the few-shot rows run back to back, placed at their shortest member"


def test_fast_template_and_tokenizer_paths_equal_the_public_calls(smol_tokenizer):
    """The framed template and the segment-cached encoder give exactly what apply_chat_template
    and tokenizer(...) give, on prompts with special-token text, unicode and odd whitespace."""
    from batchgen.job.prepare import PromptFrame, TextEncoder

    enc = TextEncoder(smol_tokenizer)
    assert enc.segments is not None and enc.template is not None
    frame = PromptFrame(enc.render, "Be brief.")
    assert frame.frame is not None and not frame.strip
    prompts = {k: p for k, p in enumerate(["Hello", "  leading and trailing  ", "a <|im_end|> inside", "\u00e9t\u00e9 \U0001f600",
                                           "line\nbreaks\n\n", "{{ jinja }}", "x" * 500, "<|im_start|>user\nsneaky"])}
    texts = frame.texts(prompts)
    want = [smol_tokenizer.apply_chat_template(frame.conversation(p), tokenize=False, add_generation_prompt=True)
            for p in prompts.values()]
    assert list(texts.values()) == want
    assert enc.encode(want, special=False) == [list(x) for x in smol_tokenizer(want, add_special_tokens=False)["input_ids"]]
    assert enc.encode(want, special=False) == enc.encode(want, special=False), "cached template parts reused"


def test_a_template_that_changes_content_is_rendered_row_by_row(smol_tokenizer):
    from batchgen.job.prepare import PromptFrame

    def render_with(template):
        return lambda convs: smol_tokenizer.apply_chat_template(convs, tokenize=False, add_generation_prompt=True,
                                                                chat_template=template)

    trimmed = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] | trim }}</s>{% endfor %}<bot>"
    f = PromptFrame(render_with(trimmed), None)
    assert f.frame is not None and f.strip, "a trimming template frames the stripped prompt"
    assert f.texts({0: "  hi  "}) == {0: "<user>hi</s><bot>"}
    upper = "{% for m in messages %}{{ m['content'] | upper }}{% endfor %}"
    assert PromptFrame(render_with(upper), None).frame is None
    # A branch on content that no probe trips is caught by the per-window sample of real rows.
    branch = "{% for m in messages %}{% if 'secret' in m['content'] %}[redacted]{% else %}{{ m['content'] }}{% endif %}{% endfor %}"
    f = PromptFrame(render_with(branch), None)
    assert f.frame is not None
    assert f.texts({0: "the secret is out"}) is None and f.frame is None, "the sample disagreed: framing is off"


# Gemma 2's template: no system role (Gemma 3's folds it into the first user turn itself).
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% set role = 'model' if message['role'] == 'assistant' else "
    "message['role'] %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_a_template_without_a_system_role_gets_the_system_prompt_in_the_first_user_turn(tmp_path, smol_tokenizer):
    """The job's system prompt and a row's own system message both join the first user turn as
    "system\\n\\nuser", where the template refuses the system role; no row becomes an error."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = GEMMA2_TEMPLATE
    q = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt": ["Name a colour.", "Name a fruit."]}), q)
    rows, errors = prepare_all(_spec(path=str(q), id_column="id", system_prompt="Be brief."), tok, 8192)
    assert not errors
    assert tok.decode(list(rows[0].token_ids)).endswith(
        "<start_of_turn>user\nBe brief.\n\nName a colour.<end_of_turn>\n<start_of_turn>model\n")
    m = tmp_path / "m.parquet"
    msgs = [[{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello"},
             {"role": "assistant", "content": "Hi"}, {"role": "user", "content": "Bye"}],
            [{"role": "user", "content": "Plain"}]]
    pq.write_table(pa.table({"id": ["a", "b"], "msgs": msgs}), m)
    rows, errors = prepare_all(_spec(path=str(m), messages_column="msgs", id_column="id"), tok, 8192)
    assert not errors
    text = tok.decode(list(rows[0].token_ids))
    assert "<start_of_turn>user\nBe terse.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi" in text
    assert tok.decode(list(rows[1].token_ids)).endswith("<start_of_turn>user\nPlain<end_of_turn>\n<start_of_turn>model\n")


def test_a_base_model_without_a_chat_template(tmp_path, smol_tokenizer):
    """A base model's tokenizer (a GGUF of one, say) has no template: prompts run as they are;
    asking for the template, or a messages column, is refused with what to set instead."""
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = None
    q = tmp_path / "p.parquet"
    pq.write_table(pa.table({"id": ["a"], "prompt": ["Once upon a time"], "msgs": [[{"role": "user", "content": "x"}]]}), q)
    rows, errors = prepare_all(_spec(path=str(q), id_column="id"), tok, 8192)
    assert not errors and tok.decode(list(rows[0].token_ids)) == "Once upon a time"
    for spec in (_spec(path=str(q), id_column="id", chat_template=True),
                 _spec(path=str(q), id_column="id", messages_column="msgs")):
        with pytest.raises(InputError, match="has no chat template; set chat_template: false"):
            prepare_all(spec, tok, 8192)
