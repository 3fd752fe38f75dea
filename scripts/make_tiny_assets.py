"""Build the bundled tiny model and fine-tuning task (the result is committed).

    python scripts/make_tiny_assets.py      # a few minutes on a CPU

Writes
  lora_sweep/assets/tiny-llama/   a 0.7M-parameter Llama (GQA) + byte-level BPE tokenizer,
                                  pretrained on a generated English-like corpus about a small
                                  world: 40 animals, each with a fixed colour, home, food, size
                                  and sound; heldout.txt is unseen text from the same world.
  lora_sweep/assets/tiny-task/    train.jsonl / eval.jsonl: {"prompt": "fox ? food , size :",
                                  "completion": " apples , big ."}. The facts are in the model,
                                  the terse format is not, so zero-shot loss is high and a short
                                  LoRA fine-tune learns it at a good learning rate but not a tiny one.

and finishes with that check: a PEFT LoRA fine-tune at a few learning rates.
Everything is seeded, so a rerun gives the same corpus, task and (up to float
reordering across thread counts) the same model.
"""

import json
import math
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ASSETS = Path(__file__).resolve().parent.parent / "lora_sweep" / "assets"
MODEL_DIR = ASSETS / "tiny-llama"
TASK_DIR = ASSETS / "tiny-task"
SEED = 1234

# -----------------------------------------------------------------------------
# the world and its corpus

ANIMALS = ("fox dog cat bird horse cow sheep wolf bear mouse rabbit duck goat pig owl frog deer lion "
           "tiger snake fish hen bee crab seal whale ant bat eagle goose mole otter panda llama camel "
           "zebra shark swan toad yak").split()
VALUES = {  # attribute -> the values an animal can have; each animal gets one of each, at random
    "color": "red blue green brown white black gray yellow".split(),
    "home": "forest river hill farm lake field cave garden barn meadow".split(),
    "food": "apples bread corn grass seeds berries nuts honey leaves carrots".split(),
    "size": "tiny small big huge".split(),
    "sound": "moo quack hiss howl purr buzz chirp growl squeak roar".split(),
}
NAMES = "anna tom lucy ben mia sam eva leo".split()
ADJS = "old young happy quiet fast slow hungry sleepy".split()  # disjoint from the fact values
SEEN = "saw fed found watched followed chased heard liked".split()
MOVED = "ran walked jumped slept sang waited played rested".split()
WHEN = ("in the morning", "at night", "after lunch", "every day", "on monday", "in the rain", "at noon")
COUNT = "one two three four five six seven eight nine ten".split()


def make_world(rng):
    """Each animal's fixed facts: {animal: {attribute: value}}."""
    return {a: {k: rng.choice(v) for k, v in VALUES.items()} for a in ANIMALS}


def fact_sentence(rng, a, f):
    """One true statement about animal `a`, in one of several phrasings."""
    k = rng.choice(list(VALUES))
    return rng.choice({
        "color": [f"the {a} is {f['color']} .", f"the color of the {a} is {f['color']} .",
                  f"a {f['color']} {a} is a {a} ."],
        "home": [f"the {a} lives in the {f['home']} .", f"the home of the {a} is the {f['home']} .",
                 f"the {a} went back to the {f['home']} {rng.choice(WHEN)} ."],
        "food": [f"the {a} eats {f['food']} .", f"the food of the {a} is {f['food']} .",
                 f"{rng.choice(NAMES)} gave some {f['food']} to the {a} ."],
        "size": [f"the {a} is {f['size']} .", f"the size of the {a} is {f['size']} .",
                 f"a {a} is a {f['size']} animal ."],
        "sound": [f"the {a} says {f['sound']} .", f"the sound of the {a} is {f['sound']} .",
                  f"{rng.choice(NAMES)} heard the {a} say {f['sound']} ."],
    }[k])


def story_sentence(rng, a, f):
    """A sentence about people and animals that is consistent with the facts but not one."""
    n, m = rng.sample(NAMES, 2)
    return rng.choice([
        f"{n} {rng.choice(SEEN)} the {rng.choice(ADJS)} {a} {rng.choice(WHEN)} .",
        f"{n} saw a {f['color']} {a} near the {f['home']} .",
        f"the {rng.choice(ADJS)} {a} {rng.choice(MOVED)} {rng.choice(WHEN)} .",
        f"{n} and {m} {rng.choice(MOVED)} in the {rng.choice(VALUES['home'])} .",
        f"{n} has {rng.choice(COUNT)} {rng.choice(VALUES['food'])} and {m} has {rng.choice(COUNT)} .",
        f"did {n} see the {a} ? yes , {n} saw the {a} in the {f['home']} .",
        f"{n} said : the {a} is {f['size']} and {f['color']} .",
    ])


def make_doc(rng, world):
    """A few sentences, mostly about one animal (so facts have a topic to attach to)."""
    a = rng.choice(ANIMALS)
    sents = []
    for _ in range(rng.randint(2, 6)):
        if rng.random() < 0.2:
            a = rng.choice(ANIMALS)  # topic switch
        make = fact_sentence if rng.random() < 0.5 else story_sentence
        sents.append(make(rng, a, world[a]))
    return " ".join(sents)


# -----------------------------------------------------------------------------
# the fine-tuning task: ask for facts in a format the corpus never uses

def make_task(rng, world, n_train, n_eval):
    """Rows {"prompt": "fox ? food , size :", "completion": " apples , big ."}; eval questions are unseen in train."""
    questions = {}  # a dict, not a set: distinct and in drawing order, so the split is deterministic
    while len(questions) < n_train + n_eval:
        keys = tuple(rng.sample(list(VALUES), rng.randint(1, 3)))
        questions[(rng.choice(ANIMALS), keys)] = None
    rows = [{"prompt": f"{a} ? {' , '.join(keys)} :", "completion": " " + " , ".join(world[a][k] for k in keys) + " ."}
            for a, keys in questions]
    return rows[:n_train], rows[n_train:]


# -----------------------------------------------------------------------------
# tokenizer

def train_tokenizer(texts, vocab_size):
    """Byte-level BPE (GPT-2 style) so any text encodes; prepends <s> like Llama."""
    specials = ["<unk>", "<s>", "</s>", "<pad>"]  # pad is its own token so padding never looks like an end
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # add_prefix_space: every word, the first included, is "Ġword", so prompt + completion (which starts
    # with a space) tokenizes the same whether encoded together or apart
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=256)


# -----------------------------------------------------------------------------
# pretraining

@torch.no_grad()
def lm_loss(model, tokenizer, texts):
    """Mean next-token loss over `texts` (nats per token), one text per row."""
    model.eval()
    total, count = 0.0, 0
    for text in texts:
        ids = tokenizer(text, return_tensors="pt").input_ids
        total += model(input_ids=ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    model.train()
    return total / count


def get_lr(step, steps, lr, warmup=100):
    """Linear warmup, then cosine decay to lr/10 (as nanoGPT)."""
    if step < warmup:
        return lr * step / warmup
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup))))


def pretrain(model, stream, steps, batch_size, seq_len, lr, log_every, eval_fn):
    """nanoGPT-style loop on random windows of one token stream."""
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on norms
    other = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(SEED)
    t0 = time.time()
    for step in range(steps + 1):
        # set lr
        for g in opt.param_groups:
            g["lr"] = get_lr(step, steps, lr)
        # eval
        if step % log_every == 0:
            print(f"  step {step:5d}  held-out loss {eval_fn():.3f}  ({time.time() - t0:.0f}s)", flush=True)
        if step == steps:
            break
        # forward/backward on a batch of random windows
        starts = torch.randint(0, len(stream) - seq_len, (batch_size,), generator=gen)
        x = torch.stack([stream[s : s + seq_len] for s in starts])  # (batch, seq_len)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


@torch.no_grad()
def facts_recalled(model, tokenizer, world):
    """How many facts the model completes greedily from "the <attribute> of the <animal> is"."""
    hits = 0
    for a, facts in world.items():
        for k, v in facts.items():
            ids = tokenizer(f"the {k} of the {a} is" + (" the" if k == "home" else ""), return_tensors="pt").input_ids
            hits += model(input_ids=ids).logits[0, -1].argmax().item() == tokenizer(" " + v, add_special_tokens=False).input_ids[0]
    return hits


# -----------------------------------------------------------------------------
# the check: a short LoRA fine-tune responds to the learning rate

def encode_rows(tokenizer, rows):
    """(input_ids, labels) per row; loss on completion tokens only."""
    out = []
    for r in rows:
        p = tokenizer(r["prompt"]).input_ids
        c = tokenizer(r["completion"], add_special_tokens=False).input_ids
        out.append((p + c, [-100] * len(p) + c))
    return out


def collate(batch, pad_id):
    n = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([i + [pad_id] * (n - len(i)) for i, _ in batch])
    labels = torch.tensor([l + [-100] * (n - len(l)) for _, l in batch])
    return ids, labels, (ids != pad_id).long()


@torch.no_grad()
def task_loss(model, data, pad_id):
    """Mean completion-token loss and greedy token accuracy over `data`."""
    model.eval()
    ids, labels, mask = collate(data, pad_id)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100)
    keep = target != -100
    acc = (logits.argmax(-1) == target)[keep].float().mean()
    model.train()
    return loss.item(), acc.item()


def lora_finetune(model_dir, train, eval_, pad_id, lr, steps, batch_size, rank):
    """PEFT LoRA on all 7 projections, constant lr, dropout 0; returns the eval (loss, token accuracy)."""
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    rng = random.Random(SEED)  # the same data order at every lr
    for _ in range(steps):
        ids, labels, mask = collate(rng.sample(train, batch_size), pad_id)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return task_loss(model, eval_, pad_id)


# -----------------------------------------------------------------------------

def main():
    rng = random.Random(SEED)
    torch.manual_seed(SEED)
    t0 = time.time()

    world = make_world(rng)
    corpus = [make_doc(rng, world) for _ in range(40_000)]
    heldout = [make_doc(rng, world) for _ in range(64)]  # drawn after the corpus: unseen documents
    train_rows, eval_rows = make_task(rng, world, n_train=2000, n_eval=128)

    tokenizer = train_tokenizer(corpus, vocab_size=1024)  # a cap: merges run out near 650, each word one token
    print(f"tokenizer: {len(tokenizer)} tokens")

    # documents as one stream "<s> doc </s> <s> doc </s> ...", cut into random windows
    stream = torch.tensor([t for d in corpus for t in tokenizer(d).input_ids + [tokenizer.eos_token_id]])
    print(f"corpus: {len(corpus)} documents, {len(stream)} tokens")

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=320, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,  # GQA, as in the real models the sweep targets
        max_position_embeddings=256, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters; uniform loss would be {math.log(len(tokenizer)):.3f}")
    pretrain(model, stream, steps=2000, batch_size=32, seq_len=64, lr=3e-3, log_every=250,
             eval_fn=lambda: lm_loss(model, tokenizer, heldout))

    # save, then check both load back offline
    MODEL_DIR.mkdir(parents=True, exist_ok=True)
    TASK_DIR.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(MODEL_DIR)
    tokenizer.save_pretrained(MODEL_DIR)
    (MODEL_DIR / "heldout.txt").write_text("\n".join(heldout) + "\n")
    for name, rows in (("train", train_rows), ("eval", eval_rows)):
        with open(TASK_DIR / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR)
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR)
    size_mb = sum(p.stat().st_size for p in MODEL_DIR.iterdir()) / 2**20
    print(f"saved {MODEL_DIR} ({size_mb:.1f} MB); held-out loss after reload {lm_loss(model, tokenizer, heldout):.3f}, "
          f"facts recalled {facts_recalled(model, tokenizer, world)}/{len(ANIMALS) * len(VALUES)}")

    # the check: zero-shot vs a short LoRA fine-tune at several learning rates
    train, eval_ = encode_rows(tokenizer, train_rows), encode_rows(tokenizer, eval_rows)
    loss, acc = task_loss(model, eval_, tokenizer.pad_token_id)
    print(f"task eval, zero-shot: loss {loss:.3f}  token acc {acc:.2f}")
    for lr in (2e-5, 1e-4, 3e-4, 1e-3, 3e-3):
        loss, acc = lora_finetune(MODEL_DIR, train, eval_, tokenizer.pad_token_id, lr, steps=40, batch_size=4, rank=8)
        print(f"task eval, LoRA r=8 lr={lr:g} 40 steps x batch 4: loss {loss:.3f}  token acc {acc:.2f}", flush=True)
    print(f"done in {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
