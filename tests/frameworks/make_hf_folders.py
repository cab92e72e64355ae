"""Writes the folders that Hugging Face training tools leave, with the tools themselves, and
beside each what the tool loads back from it, for tests/frameworks/test_hf_folders.py.

    python make_hf_folders.py OUT

Run by the python of an overlay environment (tests/requirements-tf4.txt: transformers 4.57 with
accelerate; tests/requirements-tf5.txt: accelerate and PEFT over the base's transformers 5.x);
which cases it writes follows from the transformers it imports:

  transformers 4.x  trainer-bin          Trainer(save_safetensors=False): checkpoint-3/ with
                                         pytorch_model.bin, optimizer.pt, scheduler.pt,
                                         rng_state.pth, training_args.bin, trainer_state.json
                    trainer-safetensors  the same with save_safetensors=True (model.safetensors)
                    sharded-bin          save_pretrained(max_shard_size, safe_serialization=False):
                                         pytorch_model-0000i-of-0000n.bin + index
                    sharded-safetensors  the same in safetensors
  transformers 5.x  trainer              Trainer with its defaults
                    accelerate-bin       Accelerator.save_state(safe_serialization=False) of one
                                         model, its optimizer and scheduler and a registered object
                    accelerate-safetensors  save_state() of two models and two optimizers
                    peft-safetensors     PeftModel.save_pretrained (adapter_model.safetensors)
                    peft-bin             the same with safe_serialization=False (adapter_model.bin)

OUT/<case>/ holds `folder/` (what the tool wrote; for the Trainer, its output_dir with
checkpoint-3/ inside), `reference.safetensors` (the tensors the tool loads back: from_pretrained's
state_dict, load_state's model, PEFT's load_peft_weights), and `case.json`: the checkpoint folder
(relative), the weight files the tool reads, the keys those files hold, the versions.
"""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

torch.set_num_threads(1)
TF_MAJOR = int(transformers.__version__.split(".")[0])


def tiny_gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


class TokenData(torch.utils.data.Dataset):
    def __init__(self, count=12, length=8):
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (count, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def file_keys(folder: Path, names) -> list:
    """The keys stored in weight files NAMES of FOLDER, read as the loaders read them."""
    keys = []
    for name in names:
        path = folder / name
        if name.endswith(".safetensors"):
            keys += list(load_file(path))
        else:
            keys += list(torch.load(path, map_location="cpu", weights_only=True))
    return keys


def contiguous(state: dict) -> dict:
    """Tensors save_file accepts: tied ones (one storage) become copies."""
    return {k: v.detach().clone().contiguous() for k, v in state.items()}


def write_case(out: Path, name: str, checkpoint: Path, weights, reference: dict, **extra) -> None:
    case = out / name
    save_file(contiguous(reference), case / "reference.safetensors")
    record = {
        "checkpoint": str(checkpoint.relative_to(case)),
        "weights": list(weights),
        "keys": file_keys(checkpoint, weights),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        **extra,
    }
    (case / "case.json").write_text(json.dumps(record, indent=1))


def index_shards(folder: Path, index: str) -> list:
    return sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))


def trainer_case(out: Path, name: str, **arg_overrides) -> None:
    """Three steps of a Trainer on a tiny GPT-2, saved at step 3: checkpoint-3/ is what a user
    mounts, the output_dir above it a folder with checkpoints only in a subfolder."""
    folder = out / name / "folder"
    args = dict(
        output_dir=str(folder),
        max_steps=3,
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=5,
        dataloader_num_workers=0,
    )
    args.update(arg_overrides)
    trainer = transformers.Trainer(model=tiny_gpt2(), args=transformers.TrainingArguments(**args), train_dataset=TokenData())
    trainer.train()
    checkpoint = folder / "checkpoint-3"
    names = {p.name for p in checkpoint.iterdir()}
    if "model.safetensors" in names:
        weights = ["model.safetensors"]
    elif "pytorch_model.bin" in names:
        weights = ["pytorch_model.bin"]
    else:
        raise SystemExit(f"{name}: the Trainer wrote no model file we know: {sorted(names)}")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(checkpoint)
    # The optimizer state the Trainer resumes from, so the test can tell its tensors apart.
    optimizer = torch.load(checkpoint / "optimizer.pt", map_location="cpu", weights_only=True)
    write_case(out, name, checkpoint, weights, loaded.state_dict(), output_dir="folder",
               optimizer_state_tensors=sum(len(s) for s in optimizer["state"].values()))


def sharded_case(out: Path, name: str, safe: bool) -> None:
    folder = out / name / "folder"
    model = tiny_gpt2()
    model.save_pretrained(folder, max_shard_size="40KB", safe_serialization=safe)
    index = "model.safetensors.index.json" if safe else "pytorch_model.bin.index.json"
    shards = index_shards(folder, index)
    if len(shards) < 2:
        raise SystemExit(f"{name}: expected several shards, got {shards}")
    loaded = transformers.GPT2LMHeadModel.from_pretrained(folder)
    write_case(out, name, folder, shards, loaded.state_dict(), index=index)


class Mlp(torch.nn.Module):
    """A small model with a buffer (BatchNorm's running stats and int64 counter)."""

    def __init__(self, seed: int, width: int = 12):
        super().__init__()
        torch.manual_seed(seed)
        self.up = torch.nn.Linear(6, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.down = torch.nn.Linear(width, 3)

    def forward(self, x):
        return self.down(torch.relu(self.norm(self.up(x))))


class Counter:
    """An object registered for checkpointing (accelerate pickles its state_dict)."""

    def __init__(self):
        self.seen = 0

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


def accelerate_case(out: Path, name: str, safe: bool, models: int) -> None:
    import accelerate

    folder = out / name / "folder"
    accelerator = accelerate.Accelerator(cpu=True)
    nets = [Mlp(seed=10 + i, width=12 + 4 * i) for i in range(models)]
    optimizers = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in nets]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers[0], step_size=1, gamma=0.5)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    prepared = accelerator.prepare(*nets, *optimizers, scheduler)
    nets, optimizers = prepared[:models], prepared[models : 2 * models]
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(8, 6, generator=g)
        for net, opt in zip(nets, optimizers):
            loss = net(x).square().mean()
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
        scheduler.step()
        counter.seen += 8
    accelerator.save_state(str(folder), safe_serialization=safe)

    # What load_state gives back: fresh models of other initial values, loaded from the folder.
    fresh = accelerate.Accelerator(cpu=True)
    again = [Mlp(seed=99 + i, width=12 + 4 * i) for i in range(models)]
    again_opts = [torch.optim.AdamW(n.parameters(), lr=1e-2) for n in again]
    again_sched = torch.optim.lr_scheduler.StepLR(again_opts[0], step_size=1, gamma=0.5)
    fresh.register_for_checkpointing(Counter())
    prepared = fresh.prepare(*again, *again_opts, again_sched)
    fresh.load_state(str(folder))
    weights = ["model.safetensors" if safe else "pytorch_model.bin"]
    write_case(out, name, folder, weights, prepared[0].state_dict(), models=models,
               accelerate=accelerate.__version__)


def peft_case(out: Path, name: str, safe: bool) -> None:
    import peft

    folder = out / name / "folder"
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], init_lora_weights=False)
    model = peft.get_peft_model(tiny_gpt2(), config)
    model.save_pretrained(folder, safe_serialization=safe)
    weights = ["adapter_model.safetensors" if safe else "adapter_model.bin"]
    loaded = peft.utils.load_peft_weights(str(folder))
    write_case(out, name, folder, weights, loaded, peft=peft.__version__)


def main():
    out = Path(sys.argv[1])
    random.seed(0)
    np.random.seed(0)
    if TF_MAJOR == 4:
        cases = {
            "trainer-bin": lambda: trainer_case(out, "trainer-bin", save_safetensors=False),
            "trainer-safetensors": lambda: trainer_case(out, "trainer-safetensors", save_safetensors=True),
            "sharded-bin": lambda: sharded_case(out, "sharded-bin", safe=False),
            "sharded-safetensors": lambda: sharded_case(out, "sharded-safetensors", safe=True),
        }
    else:
        cases = {
            "trainer": lambda: trainer_case(out, "trainer"),
            "accelerate-bin": lambda: accelerate_case(out, "accelerate-bin", safe=False, models=1),
            "accelerate-safetensors": lambda: accelerate_case(out, "accelerate-safetensors", safe=True, models=2),
            "peft-safetensors": lambda: peft_case(out, "peft-safetensors", safe=True),
            "peft-bin": lambda: peft_case(out, "peft-bin", safe=False),
        }
    for name, make in cases.items():
        (out / name).mkdir(parents=True)
        make()
        print(f"{name}: done", flush=True)
    (out / "cases.json").write_text(json.dumps(sorted(cases)))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
