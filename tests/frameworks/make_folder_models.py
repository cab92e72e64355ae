"""Writes model folders with the frameworks' own save code, for tests/frameworks/test_mount_as_folder.py:
the loaders of the same frameworks are pointed at mounts of them there.

    python make_folder_models.py OUT        (in the overlay of scripts/setup-venv.sh folders)

OUT/
  diffusers-safetensors/  an LDMPipeline (vqvae/, unet/, scheduler/, model_index.json) saved by
                          save_pretrained
  diffusers-bin/          the same with safe_serialization=False (diffusion_pytorch_model.bin)
  sentence-transformers/  SentenceTransformer.save() of a tiny BERT with Pooling and Normalize
                          (modules.json, the transformer at the top, 1_Pooling/, 2_Normalize/)
  llama/                  a tiny LlamaForCausalLM's save_pretrained (config says float32)
  peft-safetensors/       a LoRA adapter of llama/ saved by PeftModel.save_pretrained
  peft-bin/               the same with safe_serialization=False (adapter_model.bin)
  yolo/yolo.pt            an Ultralytics DetectionModel built from its shipped yolov8n.yaml and
                          saved by its own save(); yolo/reference.safetensors: state_dict() of
                          the model torch.load unpickles, under the key it has in the saved dict
  versions.json           the frameworks' versions
"""

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file


def diffusers_pipelines(out: Path) -> None:
    from diffusers import DDIMScheduler, LDMPipeline, UNet2DModel, VQModel

    torch.manual_seed(0)
    unet = UNet2DModel(sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
                       norm_num_groups=4, down_block_types=("DownBlock2D", "DownBlock2D"),
                       up_block_types=("UpBlock2D", "UpBlock2D"))
    vqvae = VQModel(in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8,), norm_num_groups=4,
                    num_vq_embeddings=16, vq_embed_dim=3, layers_per_block=1)
    pipe = LDMPipeline(vqvae=vqvae, unet=unet, scheduler=DDIMScheduler())
    pipe.save_pretrained(out / "diffusers-safetensors")
    pipe.save_pretrained(out / "diffusers-bin", safe_serialization=False)


def sentence_transformers_folder(out: Path) -> None:
    from sentence_transformers import SentenceTransformer, models
    from transformers import BertConfig, BertModel, BertTokenizerFast

    work = out / "tiny-bert"
    torch.manual_seed(0)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + \
        ["the", "mount", "is", "a", "folder", "##s", "."]
    work.mkdir(parents=True)
    (work / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab_file=str(work / "vocab.txt")).save_pretrained(work)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(work)
    transformer = models.Transformer(str(work), max_seq_length=32)
    pooling = models.Pooling(transformer.get_word_embedding_dimension(), pooling_mode="mean")
    model = SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu")
    model.save(str(out / "sentence-transformers"))


def llama_and_adapters(out: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(out / "llama")
    base = LlamaForCausalLM.from_pretrained(out / "llama")
    # init_lora_weights=False: B is not zero, so the adapter changes the outputs.
    peft_model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft_model.save_pretrained(out / "peft-safetensors")
    peft_model.save_pretrained(out / "peft-bin", safe_serialization=False)


def ultralytics_model(out: Path) -> None:
    from ultralytics import YOLO

    folder = out / "yolo"
    folder.mkdir()
    torch.manual_seed(0)
    YOLO("yolov8n.yaml").save(str(folder / "yolo.pt"))
    saved = torch.load(folder / "yolo.pt", weights_only=False, map_location="cpu")
    reference = {}
    for name in ("model", "ema"):
        if isinstance(saved.get(name), torch.nn.Module):
            for key, tensor in saved[name].state_dict().items():
                reference[f"{name}.{key}"] = tensor.detach().clone().contiguous()
    if not reference:
        sys.exit("the saved YOLO checkpoint holds no module")
    save_file(reference, folder / "reference.safetensors")


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    # Ultralytics writes its settings under the user's config folder; keep it in OUT.
    os.environ.setdefault("YOLO_CONFIG_DIR", str(out / ".ultralytics"))
    diffusers_pipelines(out)
    sentence_transformers_folder(out)
    llama_and_adapters(out)
    ultralytics_model(out)
    import diffusers
    import peft
    import sentence_transformers
    import transformers
    import ultralytics

    versions = {m.__name__: m.__version__ for m in (torch, diffusers, peft, sentence_transformers, transformers,
                                                    ultralytics)}
    (out / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
