"""Loads a model folder and a mount of it with the framework's own loader and compares what they
compute, for tests/frameworks/test_mount_as_folder.py (run by the python of the `folders`
overlay, where diffusers and PEFT are installed). Exits 0 and prints one line when the outputs
are identical; raises otherwise.

    python check_folder_loaders.py diffusers ORIGINAL MOUNT [fp16]
    python check_folder_loaders.py sentence-transformers ORIGINAL MOUNT
    python check_folder_loaders.py peft BASE ORIGINAL_ADAPTER MOUNTED_ADAPTER
    python check_folder_loaders.py transformers-bf16 ORIGINAL MOUNT
"""

import sys
from pathlib import Path

import torch


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        raise SystemExit(f"{what}: outputs differ ({a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)})")


def check_diffusers(original: Path, mount: Path, dtype_name: str = "") -> str:
    from diffusers import DiffusionPipeline, UNet2DModel, VQModel

    kwargs = {"torch_dtype": torch.float16} if dtype_name == "fp16" else {}

    def images(folder: Path) -> torch.Tensor:
        pipe = DiffusionPipeline.from_pretrained(folder, **kwargs)
        generator = torch.Generator().manual_seed(0)
        out = pipe(batch_size=1, generator=generator, num_inference_steps=2, output_type="pt").images
        return torch.as_tensor(out)

    if kwargs:
        # The pipeline (an LDMPipeline) makes its latents in float32 whatever its modules'
        # dtype, so it cannot run in fp16: its modules are compared weight by weight, and each
        # component is run in fp16 below.
        a, b = DiffusionPipeline.from_pretrained(mount, **kwargs), DiffusionPipeline.from_pretrained(original, **kwargs)
        for name in ("unet", "vqvae"):
            sa, sb = getattr(a, name).state_dict(), getattr(b, name).state_dict()
            if sorted(sa) != sorted(sb):
                raise SystemExit(f"pipeline {name}: other keys")
            for key in sa:
                if sa[key].dtype != torch.float16:
                    raise SystemExit(f"pipeline {name}.{key} loaded as {sa[key].dtype}")
                same(sa[key], sb[key], f"pipeline {name}.{key}")
    else:
        same(images(mount), images(original), "DiffusionPipeline")
    # Each component by its own loader, from its subfolder of the mount, run in its dtype.
    for name, cls in (("unet", UNet2DModel), ("vqvae", VQModel)):
        a = cls.from_pretrained(mount / name, **kwargs)
        b = cls.from_pretrained(original / name, **kwargs)
        if a.dtype != kwargs.get("torch_dtype", torch.float32):
            raise SystemExit(f"{name}.from_pretrained(mount) built a {a.dtype} model")
        torch.manual_seed(1)
        x = torch.randn(1, 3, 8, 8).to(a.dtype)
        if name == "unet":
            same(a(x, 1).sample, b(x, 1).sample, f"{name}.from_pretrained")
        else:
            same(a(x).sample, b(x).sample, f"{name}.from_pretrained")
    return "diffusers pipeline and components identical"


def check_sentence_transformers(original: Path, mount: Path) -> str:
    from sentence_transformers import SentenceTransformer

    sentences = ["the mount is a folder.", "a folder is the mount"]
    a = SentenceTransformer(str(mount), device="cpu").encode(sentences, convert_to_tensor=True)
    b = SentenceTransformer(str(original), device="cpu").encode(sentences, convert_to_tensor=True)
    same(a, b, "SentenceTransformer.encode")
    return "sentence-transformers embeddings identical"


def check_peft(base: Path, original: Path, mount: Path) -> str:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 17, 33]])

    def logits(adapter: Path) -> torch.Tensor:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter)
        with torch.no_grad():
            return model(ids).logits

    plain = AutoModelForCausalLM.from_pretrained(base)
    with torch.no_grad():
        base_logits = plain(ids).logits
    mounted = logits(mount)
    same(mounted, logits(original), "PeftModel.from_pretrained")
    if torch.equal(mounted, base_logits):
        raise SystemExit("the adapter changes nothing: the check could not tell a missing adapter")
    return "PEFT adapter outputs identical"


def check_transformers_bf16(original: Path, mount: Path) -> str:
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 9, 17, 33]])
    mounted = AutoModelForCausalLM.from_pretrained(mount)  # no dtype: the config's
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.bfloat16)
    if mounted.dtype != torch.bfloat16:
        raise SystemExit(f"from_pretrained(mount) built a {mounted.dtype} model")
    with torch.no_grad():
        same(mounted(ids).logits, reference(ids).logits, "from_pretrained logits")
    return "transformers bf16 logits identical"


def main() -> None:
    kind, *paths = sys.argv[1:]
    if kind == "diffusers":
        line = check_diffusers(Path(paths[0]), Path(paths[1]), *paths[2:])
    elif kind == "sentence-transformers":
        line = check_sentence_transformers(Path(paths[0]), Path(paths[1]))
    elif kind == "peft":
        line = check_peft(Path(paths[0]), Path(paths[1]), Path(paths[2]))
    elif kind == "transformers-bf16":
        line = check_transformers_bf16(Path(paths[0]), Path(paths[1]))
    else:
        raise SystemExit(f"unknown check {kind}")
    print(line)


if __name__ == "__main__":
    main()
