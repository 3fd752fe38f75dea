"""PackedJob behaviour: dropout, PEFT round trip, join/leave, isolation, loading."""

from __future__ import annotations

import torch
from peft import PeftModel
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM

import lora_sweep as ls
from lora_sweep.data import collate
from lora_sweep.engine import Failed, Finished, PackedJob, Report
from lora_sweep.kernels import dropout_keep_mask
from lora_sweep.layers import mix_seed

from test_engine_equivalence import make_spec, run_packed


def trial(tid, **kw):
    base = dict(rank=4, alpha=8, learning_rate=2e-3, batch_size=2, max_steps=8, dropout=0.0, seed=len(tid))
    return ls.TrialConfig(trial_id=tid, **{**base, **kw})


def finals(job: PackedJob, tids) -> dict[str, dict[str, torch.Tensor]]:
    return {t: load_file(f"{job.finished[t]}/adapter_model.safetensors") for t in tids}


def assert_bit_identical(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- dropout


class MaskedDropout(nn.Module):
    """Stands in for PEFT's nn.Dropout on the LoRA branch, applying the packed layer's mask.

    How the masks are matched: a packed adapter's mask is `dropout_keep_mask(seed, rows, in, p)`
    with seed = mix_seed(trial seed, layer index, the adapter's micro-step) and rows counted
    from the start of its own segment. The reference runs the same rows (the adapter's slice of
    the packed microbatch, so the padded length is the same) and draws the same mask here."""

    def __init__(self, seed: int, p: float):
        super().__init__()
        self.seed, self.p = seed, p

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        keep = dropout_keep_mask(self.seed, flat.shape[0], flat.shape[1], self.p, device=x.device)
        return (flat * keep.to(x.dtype) / (1 - self.p)).reshape(x.shape)


def test_dropout_gradients_match_peft_given_the_same_mask(tiny_llama_dir, toy_data, tmp_path):
    trials = [trial("a", dropout=0.3, seed=11, rank=8), trial("b", dropout=0.1, seed=12, batch_size=3)]
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path), trials, progress=False)
    for t in job.trials:
        job.save_adapter(t, str(tmp_path / "init" / t))

    # one packed forward/backward, as the engine's step does it
    groups = [[job.train_samples[i] for i in range(k, k + c.batch_size)] for k, c in zip((0, 10), trials)]
    batch = collate(groups, job.pad_id, "cpu", job.pad_length)  # the rows the packed forward sees
    job.model.train()
    sums, counts = job._adapter_losses([job.active[c.trial_id] for c in trials], groups, train=True)
    (sums / counts).sum().backward()

    row = 0
    for cfg in trials:
        rows = slice(row, row + cfg.batch_size)
        row += cfg.batch_size
        base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, attn_implementation="eager")
        ref = PeftModel.from_pretrained(base, str(tmp_path / "init" / cfg.trial_id), is_trainable=True)
        ref.train()
        for name, layer in job.layers.items():
            peft_layer = ref.get_submodule(f"base_model.model.{name}")
            peft_layer.lora_dropout["default"] = MaskedDropout(mix_seed(cfg.seed, layer.layer_index, 0), cfg.dropout)
        out = ref(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                  labels=batch["labels"][rows])
        out.loss.backward()
        key = job.active[cfg.trial_id].key
        for name, layer in job.layers.items():
            peft_layer = ref.get_submodule(f"base_model.model.{name}")
            for which in ("lora_A", "lora_B"):
                got = getattr(layer, which)[key].weight.grad
                want = getattr(peft_layer, which)["default"].weight.grad
                assert torch.allclose(got, want, rtol=1e-5, atol=1e-7), (cfg.trial_id, name, which)


def test_dropout_masks_reproduce_and_differ_per_adapter():
    a = dropout_keep_mask(7, 16, 32, 0.5)
    assert torch.equal(a, dropout_keep_mask(7, 16, 32, 0.5))
    assert not torch.equal(a, dropout_keep_mask(8, 16, 32, 0.5))
    assert 0.3 < a.float().mean().item() < 0.7


# ---------------------------------------------------------------- PEFT round trip


def test_saved_adapter_loads_in_peft_with_the_same_logits(tiny_qwen_dir, toy_data, tmp_path):
    job = PackedJob(make_spec(tiny_qwen_dir, toy_data, tmp_path, eval_every=4),
                    [trial("a", rank=8), trial("b", target_modules=("q_proj", "v_proj"))], progress=False)
    events = job.run()
    for event in events:  # stop mid-run, after some training, while both are still active
        if isinstance(event, Report) and event.step == 4 and event.trial_id == "b":
            break
    batch = collate([job.train_samples[:3]], job.pad_id, "cpu")
    for tid in ("a", "b"):
        path = job.save_adapter(tid, str(tmp_path / "saved" / tid))
        packed = job.adapter_logits(tid, batch["input_ids"], batch["attention_mask"])
        base = AutoModelForCausalLM.from_pretrained(tiny_qwen_dir, dtype=torch.float32, attn_implementation="eager")
        peft_model = PeftModel.from_pretrained(base, path).eval()
        with torch.no_grad():
            ref = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        mask = batch["attention_mask"].bool()
        assert torch.allclose(packed[mask], ref[mask], rtol=1e-5, atol=1e-5)
        # and the adapter really changed the model
        with torch.no_grad(), peft_model.disable_adapter():
            plain = peft_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        assert (plain[mask] - ref[mask]).abs().max() > 1e-4
    events.close()


# ---------------------------------------------------------------- join and leave


def test_trial_joining_at_step_5_trains_as_if_alone(tiny_llama_dir, toy_data, tmp_path):
    late = trial("late", rank=8, batch_size=3, learning_rate=3e-3)
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "packed", eval_every=5, padding="max_seq_len"),
                    [trial("a"), trial("b", batch_size=1)], progress=False)
    joined_at = None
    for event in job.run():
        if isinstance(event, Report) and event.trial_id == "a" and event.step == 5:
            job.add_trial(late)
            joined_at = len(job.step_stats)
    assert joined_at == 5 and "late" in job.finished

    alone = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "alone", eval_every=5, padding="max_seq_len"),
                      [trial("late", rank=8, batch_size=3, learning_rate=3e-3)], progress=False)
    run_packed(alone)
    assert_bit_identical(finals(job, ["late"])["late"], finals(alone, ["late"])["late"])


def test_removing_a_trial_leaves_the_others_unchanged(tiny_llama_dir, toy_data, tmp_path):
    def run(remove: bool):
        job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / str(remove), eval_every=1, padding="max_seq_len"),
                        [trial("a"), trial("gone", rank=16, batch_size=4), trial("c", batch_size=1)], progress=False)
        events = []
        for event in job.run():
            events.append(event)
            if remove and isinstance(event, Report) and event.trial_id == "gone" and event.step == 3:
                job.remove_trial("gone")
        return job, events

    kept, kept_events = run(False)
    removed, removed_events = run(True)
    assert "gone" not in removed.finished and "gone" in kept.finished
    assert not any(isinstance(e, Report) and e.trial_id == "gone" and e.step > 3 for e in removed_events)
    assert_bit_identical(finals(kept, ["a", "c"])["a"], finals(removed, ["a", "c"])["a"])
    assert_bit_identical(finals(kept, ["a", "c"])["c"], finals(removed, ["a", "c"])["c"])


# ---------------------------------------------------------------- isolation


def test_diverging_adapter_fails_alone_and_pack_mates_are_bit_identical(tiny_llama_dir, toy_data, tmp_path):
    mates = [trial("a"), trial("c", rank=8, batch_size=3)]
    bomb = trial("bomb", learning_rate=1e30, max_grad_norm=None)

    with_bomb = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "with", padding="max_seq_len"), mates + [bomb], progress=False)
    events = list(with_bomb.run())
    failed = [e for e in events if isinstance(e, Failed)]
    assert [e.trial_id for e in failed] == ["bomb"] and "non-finite" in failed[0].reason
    assert {e.trial_id for e in events if isinstance(e, Finished)} == {"a", "c"}

    without = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / "without", padding="max_seq_len"),
                        [trial("a"), trial("c", rank=8, batch_size=3)], progress=False)
    ref_events = list(without.run())
    got, want = finals(with_bomb, ["a", "c"]), finals(without, ["a", "c"])
    for t in ("a", "c"):
        assert_bit_identical(got[t], want[t])
    losses = lambda evs, t: [e.metrics["train_loss"] for e in evs if isinstance(e, Report) and e.trial_id == t]  # noqa: E731
    assert losses(events, "a") == losses(ref_events, "a")


# ---------------------------------------------------------------- loading


def test_factory_model_and_tokenizer(tiny_llama_dir, toy_data, tmp_path, char_tokenizer):
    factory = lambda: AutoModelForCausalLM.from_pretrained(tiny_llama_dir)  # noqa: E731
    spec = make_spec(factory, toy_data, tmp_path, tokenizer=char_tokenizer, eval_data=toy_data[1], eval_every=4)
    events = list(PackedJob(spec, [trial("a", max_steps=4)], progress=False).run())
    assert isinstance(events[-1], Finished) and events[-1].metrics["eval_loss"] > 0


def test_from_pretrained_dir_loads_the_saved_weights(tiny_llama_dir, toy_data, tmp_path):
    job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path), [], progress=False)
    saved = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    assert torch.equal(job.model.get_input_embeddings().weight, saved.get_input_embeddings().weight)
    layer = job.layers["model.layers.0.self_attn.q_proj"]
    assert torch.equal(layer.base_layer.weight, saved.model.layers[0].self_attn.q_proj.weight)
    assert not any(p.requires_grad for p in job.model.parameters())


def test_gradient_checkpointing_gives_the_same_training(tiny_llama_dir, toy_data, tmp_path):
    def run(checkpointing):
        job = PackedJob(make_spec(tiny_llama_dir, toy_data, tmp_path / str(checkpointing),
                                  gradient_checkpointing=checkpointing),
                        [trial("a", dropout=0.2), trial("b", rank=8, batch_size=3)], progress=False)
        return run_packed(job), finals(job, ["a", "b"])

    (plain_losses, plain), (ckpt_losses, ckpt) = run(False), run(True)
    assert plain_losses == ckpt_losses  # the recomputed forward sees the same adapters and masks
    for t in ("a", "b"):
        for k in plain[t]:
            assert torch.allclose(plain[t][k], ckpt[t][k], rtol=1e-6, atol=1e-8), (t, k)
