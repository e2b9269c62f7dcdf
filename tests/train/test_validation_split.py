from dflash_tfm.train.validation_split import hash_fraction, split_validation


def test_split_is_stable_when_data_grows() -> None:
    """Rows held out of a small data set stay held out, and its training rows stay training rows, when the
    data set grows (a continued run validates on rows no earlier run trained on)."""
    small = [f"sharegpt:{i}" for i in range(500)]
    grown = small + [f"gsm8k:{i}" for i in range(2000)]
    val_small, train_small = split_validation(small, str, 0.05)
    val_grown, train_grown = split_validation(grown, str, 0.05)
    assert set(val_small) <= set(val_grown) and set(train_small) <= set(train_grown)
    assert 0.03 < len(val_grown) / len(grown) < 0.07
    assert train_grown == [k for k in grown if k not in set(val_grown)]  # training rows keep their order


def test_both_sides_non_empty_and_edge_cases() -> None:
    assert split_validation(["a", "b", "c"], str, 0.999)[1] and split_validation(["a", "b", "c"], str, 1e-9)[0]
    assert split_validation(["a"], str, 0.5) == ([], ["a"])
    assert split_validation(["a", "b"], str, 0.0) == ([], ["a", "b"])
    assert hash_fraction("x") == hash_fraction("x") != hash_fraction("y")


def test_extra_samples_of_a_prompt_share_its_side() -> None:
    """Rows `key#suffix` (gen-data --id-suffix: more samples of one prompt) are split by the prompt's key: a
    validation prompt never has a sample among the training rows."""
    keys = [f"gsm8k_train:{i}" for i in range(400)]
    rows = keys + [k + "#t1s1" for k in keys] + [k + "#t1s2" for k in keys]
    val, train = split_validation(rows, str, 0.1)
    prompts = {r.split("#")[0] for r in val}
    assert prompts and len(val) == 3 * len(prompts)
    assert not prompts & {r.split("#")[0] for r in train}
