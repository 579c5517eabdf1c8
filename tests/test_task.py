"""The built-in task: vocabulary order, rendering, judging, rewards."""

from transformers import AutoTokenizer

from ppo_rlhf.tasks import doubling as d


def test_vocabulary_order_and_size():
    assert len(d.VOCAB) == 42
    assert d.VOCAB[:3] == ["P", "S", "E"]
    assert "".join(d.VOCAB[3:13]) == "0123456789"
    assert "".join(d.VOCAB[13:23]) == "〇一二三四五六七八九"
    assert "".join(d.VOCAB[23:33]) == "零壹贰叁肆伍陆柒捌玖"
    assert d.VOCAB[33:] == ["数", "字", "大", "写", "小", ":", "=", "_", "x"]


def test_tokenizer_is_one_token_per_character_and_reloads(tmp_path):
    tokenizer = d.build_tokenizer()
    text = "S小写:5487x2=一〇九七四E"
    ids = tokenizer(text)["input_ids"]
    assert ids == [d.VOCAB.index(c) for c in text]
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded(text)["input_ids"] == ids
    assert reloaded.decode(ids, skip_special_tokens=True) == "小写:5487x2=一〇九七四"


def test_rendering_matches_the_spec_examples():
    assert d.prompt_text(3320, "digits") + d.render(6640, "digits") == "S数字:3320x2=6640"
    assert d.prompt_text(5487, "lower") + d.render(10974, "lower") == "S小写:5487x2=一〇九七四"
    assert d.prompt_text(3164, "upper") + d.render(6328, "upper") == "S大写:3164x2=陆叁贰捌"
    assert d.prompt_text(3320, None) == "S__:3320x2="


def test_judge_exact_value_and_style():
    assert d.judge("S数字:3320x2=", "6640", True) == (True, True, True)
    assert d.judge("S数字:3320x2=", "6640", False) == (False, True, True)  # no EOS: not exact
    assert d.judge("S数字:3320x2=", "陆陆肆零", True) == (False, True, False)  # right value, wrong style
    assert d.judge("S大写:3320x2=", "陆陆肆0", True) == (False, True, False)  # mixed styles
    assert d.judge("S大写:3320x2=", "陆陆肆陆", True) == (False, False, True)
    assert d.judge("S__:3320x2=", "六六四〇", True) == (True, True, True)  # unprefixed: any style


def test_rule_reward_grades():
    prompts = ["S小写:5487x2="] * 4
    responses = ["一〇九七四", "10974", "一〇九七五", "x"]
    assert d.rule_reward(prompts, responses, [True] * 4) == [1.0, 0.4, 0.4, 0.0]


def test_held_out_questions_never_in_training():
    task = d.make_task(seed=3, n_eval=500)
    held_out = {d.parse_prompt(r["prompt"])[0] for r in task.eval_rows()}
    trained = {d.parse_prompt(r["prompt"])[0] for r in task.sft_rows()}
    assert len(held_out) == 500 and not held_out & trained
    assert all(0 <= r["label"] < 3 for r in task.prompt_rows())
    # every SFT row is unprefixed, every PPO prompt prefixed
    assert all(r["prompt"].startswith("S__:") for r in task.sft_rows())
    assert not any(r["prompt"].startswith("S__:") for r in task.prompt_rows())
