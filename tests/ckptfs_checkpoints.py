"""The hand-built checkpoints of the suites, in one place, and the builder they are made with.

`Layouts` draws tensors from one seeded generator and makes the layouts ckptfs serves
differently: contiguous tensors (a byte range of the file), tied keys (one storage, two
keys), transposed and every-other-column views (strided: gathered element by element), a
window at an offset of another tensor's storage, 16-bit floats, integers, bool masks,
complex, 0-dim and empty tensors, special float values, and runs of small tensors of mixed
dtypes (many segment boundaries in model.safetensors). Each checkpoint below is a nested
state written with the real torch.save by its suite's fixture; each says what it covers.

A checkpoint's values follow from its seed and the order it draws in: changing the order
changes the bytes every suite compares against its own reference, not what it covers.

Importable without pytest (tests/device/device_sources.py runs on a device machine)."""

import torch

# float32 values a reader must carry bit for bit: NaN, negative zero, infinities, a subnormal.
SPECIAL_F32 = (float("nan"), -0.0, float("inf"), -float("inf"), 1e-40)


class Layouts:
    """Tensors drawn from one generator seeded with SEED (None: torch's global generator, for
    a checkpoint whose model was built from torch.manual_seed), in the order they are asked
    for."""

    def __init__(self, seed=None):
        self.g = None if seed is None else torch.Generator().manual_seed(seed)

    # --- drawn values ---------------------------------------------------------------------

    def randn(self, *shape, dtype=None) -> torch.Tensor:
        """Normal float32 values, converted to DTYPE: the values a model of that dtype holds."""
        t = torch.randn(*shape, generator=self.g)
        return t if dtype is None else t.to(dtype)

    def randn_in(self, dtype, *shape) -> torch.Tensor:
        """Normal values drawn in DTYPE itself (float64, complex)."""
        return torch.randn(*shape, generator=self.g, dtype=dtype)

    def ints(self, low: int, high: int, *shape, dtype=None) -> torch.Tensor:
        """Integers in [LOW, HIGH) drawn as int64, converted to DTYPE."""
        t = torch.randint(low, high, shape, generator=self.g)
        return t if dtype is None else t.to(dtype)

    def mask(self, *shape) -> torch.Tensor:
        """A bool tensor, about half set."""
        return torch.rand(*shape, generator=self.g) > 0.5

    def small_mixed(self, count: int, max_len: int, dtypes) -> dict:
        """COUNT small 1-d tensors `small.000`, ... of 1..MAX_LEN elements, cycling through
        DTYPES (bool, int8/int32 and floating supported)."""
        state = {}
        for i in range(count):
            n = int(torch.randint(1, max_len, (1,), generator=self.g))
            dt = dtypes[i % len(dtypes)]
            if dt == torch.bool:
                t = self.mask(n)
            elif dt in (torch.int8, torch.int32):
                t = self.ints(-100, 100, n, dtype=dt)
            else:
                t = self.randn(n, dtype=dt)
            state[f"small.{i:03d}"] = t
        return state

    # --- layouts of tensors already drawn ---------------------------------------------------

    @staticmethod
    def transposed(t: torch.Tensor) -> torch.Tensor:
        """T.t(): T's storage with swapped strides (not contiguous)."""
        return t.t()

    @staticmethod
    def every_other_column(t: torch.Tensor) -> torch.Tensor:
        """T[:, ::2]: a strided view of T's storage."""
        return t[:, ::2]

    @staticmethod
    def window(full: torch.Tensor, start: int, *shape) -> torch.Tensor:
        """The elements of FULL from START on, viewed as SHAPE: FULL's storage at an offset."""
        count = 1
        for n in shape:
            count *= n
        return full[start:start + count].view(*shape)

    @staticmethod
    def specials() -> torch.Tensor:
        return torch.tensor(SPECIAL_F32)

    @staticmethod
    def arange(*shape, start: int = 0) -> torch.Tensor:
        """int64 START, START+1, ... in SHAPE."""
        count = 1
        for n in shape:
            count *= n
        return torch.arange(start, start + count, dtype=torch.int64).reshape(*shape)


# --- the checkpoints -----------------------------------------------------------------------


def training_checkpoint() -> dict:
    """A nested training checkpoint (tests/fuse): a model with a tied weight, real Adam state
    after two steps, several dtypes, a transposed (non-contiguous) tensor, a view with a
    storage offset, a 0-dim float64, special values, and keys that contain '/' and '%'."""
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.proj = nn.Linear(16, 32)
            self.norm = nn.LayerNorm(32)
            self.out = nn.Linear(32, 16)
            self.head = nn.Linear(16, 64, bias=False)
            self.head.weight = self.embed.weight  # tied

        def forward(self, ids):
            h = self.out(torch.relu(self.norm(self.proj(self.embed(ids)))))
            return self.head(h)

    torch.manual_seed(1234)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = torch.randint(0, 64, (4, 8))
        loss = nn.functional.cross_entropy(model(ids).reshape(-1, 64), ids.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()

    lay = Layouts()  # the global generator, where the training above left it
    base = lay.randn(24, 40)
    flat = lay.randn(100)
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "epoch": 3,
        "global_step": 2,
        "extra": {
            "bf16": lay.randn(12, 20, dtype=torch.bfloat16),
            "fp16": lay.randn(9, 7, dtype=torch.float16),
            "int64": lay.arange(6, 10, start=-30),
            "mask": lay.mask(10, 6),
            "transposed": lay.transposed(base),  # (40, 24) view with strides (1, 40)
            "full": flat,
            "window": lay.window(flat, 10, 5, 8),  # shares `full`'s storage at offset 10
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "special": lay.specials(),
        },
        "layers/with/slashes": {"w%1": lay.randn(5, 6)},
    }


def concurrency_checkpoint() -> dict:
    """About 36 MB over 300+ tensors (tests/fuse): large ones so reads span many FUSE
    requests, a transposed one (served by gathering elements), and many small ones of mixed
    dtypes so random ranges of model.safetensors cross many segment boundaries."""
    lay = Layouts(7)
    state = {
        "big.f32": lay.randn(1024, 4096),
        "big.transposed": lay.transposed(lay.randn(1024, 1024)),
        "big.f16": lay.randn(2048, 1024, dtype=torch.float16),
        "big.bf16": lay.randn(2048, 1024, dtype=torch.bfloat16),
        "big.i64": lay.ints(-(2**40), 2**40, 256 * 1024),
    }
    dtypes = [torch.float32, torch.float16, torch.int8, torch.bool, torch.float64, torch.int32]
    state.update(lay.small_mixed(320, 6000, dtypes))
    return {"state": state, "note": "concurrency test"}


def large_checkpoint(megabytes: int = 256) -> dict:
    """About MEGABYTES (tests/hardening): big float32, float16, bfloat16 and int64 tensors, a
    transposed (non-contiguous, served by gathering) float32 matrix, a view with a storage
    offset, and a few hundred small tensors of mixed dtypes so that ranges of
    model.safetensors cross many segment boundaries."""
    lay = Layouts(606)
    unit = megabytes * (1 << 20) // 16  # bytes per share
    state = {
        "big.f32": lay.randn(unit * 5 // 4).reshape(-1, 1024),  # 5 shares
        "big.f16": lay.randn(unit * 3 // 2, dtype=torch.float16).reshape(-1, 512),  # 3
        "big.bf16": lay.randn(unit * 3 // 2, dtype=torch.bfloat16).reshape(-1, 256),  # 3
        "big.i64": lay.ints(-(2**40), 2**40, unit * 2 // 8),  # 2
        "big.transposed": lay.transposed(lay.randn(1024, unit * 2 // 4 // 1024)),  # 2, strides (1, n)
    }
    flat = lay.randn(unit // 4)  # 1 share
    state["window.full"] = flat
    state["window.view"] = lay.window(flat, 1000, 4096, 8)  # offset into full's storage
    dtypes = [torch.float32, torch.float16, torch.int8, torch.bool, torch.float64, torch.int32, torch.bfloat16]
    state.update(lay.small_mixed(300, 5000, dtypes))
    return {"state": state, "step": 7}


def medium_checkpoint() -> dict:
    """About 48 MB (tests/hardening faults): one 32 MB float32 tensor (many 1 MiB FUSE reads
    per pass), a transposed one, a few small ones."""
    lay = Layouts(5)
    return {
        "big": lay.randn(8 << 20).reshape(-1, 1024),
        "transposed": lay.transposed(lay.randn(1024, 2048)),
        "small": lay.arange(100),
        "half": lay.randn(1000, dtype=torch.float16),
    }


def remote_checkpoint(seed: int = 0, scale: int = 1) -> dict:
    """A nested checkpoint (tests/remote): several dtypes, a transposed (non-contiguous)
    tensor, a view at a storage offset, a tied pair and scalars; SCALE multiplies the rows
    of the larger tensors."""
    lay = Layouts(seed)
    base = lay.randn(24 * scale, 40)
    flat = lay.randn(1000)
    shared = lay.randn(64, 16)
    return {
        "model": {
            "embed.weight": shared,
            "head.weight": shared,  # tied
            "proj.weight": lay.randn(128 * scale, 64),
            "proj.bias": lay.randn(128 * scale),
            "norm.weight": lay.randn(64, dtype=torch.bfloat16),
            "half": lay.randn(33, 17, dtype=torch.float16),
            "transposed": lay.transposed(base),
            "window": lay.window(flat, 10, 5, 8),
            "ids": lay.arange(6, 10, start=-30),
            "mask": lay.mask(10, 6),
        },
        "epoch": 3,
        "note": "remote",
    }


def package_checkpoint() -> dict:
    """Tensors of the layouts the Python package serves differently (tests/pypkg): contiguous
    (a file's byte range, mapped on the CPU), a transposed view (gathered), a slice at an
    offset of a shared storage, 16-bit, integer, bool, complex, 0-d and empty tensors."""
    lay = Layouts(16)
    base = lay.randn(64, 48)
    return {
        "model": {
            "embed.weight": lay.randn(300, 96),
            "proj.weight": base,
            "proj.weight_t": lay.transposed(base),  # same storage, strided: gathered
            "tail": base[40:],  # same storage, at an offset
            "norm.weight": lay.randn(96, dtype=torch.bfloat16),
            "half": lay.randn(7, 5, dtype=torch.float16),
        },
        "ids": lay.arange(10, 100),
        "mask": lay.mask(33),
        "phase": lay.randn_in(torch.complex64, 4, 3),
        "step": torch.tensor(7),
        "empty": torch.zeros(0, 5),
    }


def device_checkpoint() -> dict:
    """What the device suite loads to device memory (tests/device): a tied pair, a tensor of
    many 4 KiB buffers and its transposed view, an every-other-column view of its own
    storage, 16-bit, float64, integer, bool, 0-dim and empty tensors."""
    lay = Layouts(8)
    big = lay.randn(300, 257)  # about 300 KiB: many 4 KiB buffers
    emb = lay.randn(37, 10)
    return {
        "model": {
            "emb.weight": emb,
            "out.weight": emb,  # tied: one storage, two keys
            "big": big,
            "big_t": lay.transposed(big),  # non-contiguous (strided) view of the same storage
            "every_other": lay.every_other_column(lay.randn(64, 40)),  # non-contiguous, own storage
            "half": lay.randn(333, dtype=torch.float16),
            "bf": lay.randn(1001, dtype=torch.bfloat16),
            "double": lay.randn(17, 3, dtype=torch.float64),
            "ids": lay.arange(1000),
            "mask": lay.mask(99),
            "scalar": torch.tensor(3.25),
            "empty": torch.zeros(0, 4),
        },
        "step": 12,
    }
