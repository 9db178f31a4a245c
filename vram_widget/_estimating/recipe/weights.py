"""How the base weights are stored: as the precision says, quantized by bitsandbytes
(``Linear4bit`` nf4 / fp4, ``Linear8bitLt`` int8), as Hugging Face's ``from_pretrained(...,
quantization_config=BitsAndBytesConfig(...))`` applies it, or by torchao's ``quantize_``
(int8 / int4 weight-only tensor subclasses), or torchao's ``NF4Tensor`` as torchtune's QLoRA
applies it (``LoRALinear(..., quantize_base=True)`` / ``FrozenNF4Linear``)."""

from __future__ import annotations

import dataclasses

from ..options import StrEnum, parse_option


class WeightFormat(StrEnum):
    """A quantized storage of the ``nn.Linear`` weights. bitsandbytes': 4-bit NormalFloat
    (``nf4``, QLoRA's), 4-bit float (``fp4``), both ``bitsandbytes.nn.Linear4bit``; or
    LLM.int8 (``int8``, ``bitsandbytes.nn.Linear8bitLt``). torchao's, applied by its
    ``quantize_``: ``int8-torchao`` (``Int8WeightOnlyConfig``: ``Int8Tensor``, int8 per
    output row) and ``int4-torchao`` (int4 in groups along the input: on the CPU
    ``PrototypeInt4WeightOnlyConfig``'s ``Int4OpaqueTensor``). ``nf4-torchao``: torchao's
    ``NF4Tensor`` (``to_nf4``: 4-bit NormalFloat codes in blocks, their scalers quantized to
    int8), as torchtune's QLoRA builds it."""

    NF4 = "nf4"
    FP4 = "fp4"
    INT8 = "int8"
    INT8_TORCHAO = "int8-torchao"
    INT4_TORCHAO = "int4-torchao"
    NF4_TORCHAO = "nf4-torchao"


# The formats torchao applies (the rest are bitsandbytes')
TORCHAO_FORMATS = (WeightFormat.INT8_TORCHAO, WeightFormat.INT4_TORCHAO, WeightFormat.NF4_TORCHAO)

# torchao's to_nf4 defaults: block_size=64, scaler_block_size=256
# (torchao/quantization/quantize_/workflows/nf4/nf4_tensor.py, ``def to_nf4``), which
# torchtune's LoRALinear and FrozenNF4Linear keep unless given ``quantization_kwargs``
NF4_SCALER_BLOCKSIZE = 256

# int4 group sizes: Int4WeightOnlyConfig's docstring ("choices are [256, 128, 64, 32]",
# torchao/quantization/quant_api.py); the CPU's Int4OpaqueTensor.from_hp asserts 32, 64 or
# 128 (torchao/prototype/quantization/int4/int4_opaque_tensor.py). Default 128, both configs'
GROUP_SIZES = (32, 64, 128, 256)


# Names that mean "not quantized": the weights in the precision's own dtype.
UNQUANTIZED = ("none", "off", "bf16", "fp16", "fp32")

# Params4bit's blocksizes (bitsandbytes/functional.py, quantize_4bit: "Valid values are 32,
# 64, 128, 256, 512, 1024, 2048, and 4096")
BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)

# The dtypes a 4-bit weight may be packed into (BitsAndBytesConfig's bnb_4bit_quant_storage)
QUANT_STORAGES = ("uint8", "int8", "float16", "bfloat16", "float32")

COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _dtype_name(value: object, what: str, valid: tuple[str, ...]) -> str:
    """A dtype as its torch name (``"bf16"``, ``"bfloat16"`` and ``torch.bfloat16`` alike)."""
    text = str(value).removeprefix("torch.").strip().lower()
    text = _DTYPE_ALIASES.get(text, text)
    if text not in valid:
        raise ValueError(f"unknown {what} {value!r}; valid values are {', '.join(valid)}")
    return text


def weight_format(value: object) -> WeightFormat | None:
    """A format as given (``"nf4"``, ``WeightFormat.NF4``; None or ``"none"``: not
    quantized), or a ValueError listing the valid ones.

    Examples
    --------
    >>> weight_format("NF4"), weight_format("off")
    (<WeightFormat.NF4: 'nf4'>, None)
    """
    if value is None or (isinstance(value, str) and value.strip().lower() in UNQUANTIZED):
        return None
    try:
        return parse_option(WeightFormat, value, "weights format")
    except ValueError:
        valid = ", ".join(repr(m.value) for m in WeightFormat)
        raise ValueError(
            f"unknown weights format {value!r}; valid values are {valid} (or None for the "
            "precision's own dtype)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Weights:
    """The base weights' quantization.

    Attributes
    ----------
    format : WeightFormat, optional
        ``"nf4"``, ``"fp4"`` or ``"int8"``; None: not quantized (the precision's dtype).
    compute_dtype : str
        ``Linear4bit``'s ``compute_dtype``: the dtype its input is cast to and the weight
        dequantized to. Default ``"float32"``, ``BitsAndBytesConfig``'s
        (transformers/utils/quantization_config.py, ``BitsAndBytesConfig.__init__``:
        ``bnb_4bit_compute_dtype`` None -> ``torch.float32``); QLoRA recipes set bf16.
    double_quant : bool
        ``compress_statistics``: the block maxima themselves quantized to 8 bits in blocks
        of 256 (QLoRA's double quantization); ``BitsAndBytesConfig``'s
        ``bnb_4bit_use_double_quant``, default False.
    blocksize : int
        Weights per 4-bit block: 64, ``Params4bit``'s default (bitsandbytes/nn/modules.py),
        which ``BitsAndBytesConfig`` does not expose; for ``nf4-torchao``, ``to_nf4``'s
        ``block_size`` (default 64, torchao's).
    scaler_blocksize : int
        ``nf4-torchao``: ``to_nf4``'s ``scaler_block_size``, the block scalers per int8
        block of the double quantization (default 256, torchao's). A weight is quantized
        only where ``blocksize * scaler_blocksize`` divides its size (torchao asserts it).
    quant_storage : str
        The dtype the packed 4-bit codes are stored as (``bnb_4bit_quant_storage``, default
        ``"uint8"``; FSDP setups pick the model's float dtype).
    int8_threshold : float
        LLM.int8's outlier threshold (``llm_int8_threshold``, default 6.0).
    skip_modules : tuple of str, optional
        ``llm_int8_skip_modules``: modules kept unquantized. None: transformers' default
        (``get_keys_to_not_convert``: the output embeddings, tied weights and the module of
        the last parameter). For torchao's formats, ``TorchAoConfig``'s
        ``modules_to_not_convert`` alike (None: the same default on a transformers model,
        nothing kept on any other module, as ``quantize_`` keeps nothing). For
        ``nf4-torchao``, None keeps a transformers model's output embeddings (torchtune never
        quantizes the output projection) and nothing on any other module.
    group_size : int
        ``int4-torchao``: weights per int4 group along the input (``group_size``, default
        128, as ``Int4WeightOnlyConfig``'s); a Linear whose input size it does not divide
        stays unquantized, as torchao leaves it.

    Examples
    --------
    >>> Weights("nf4", double_quant=True).format
    <WeightFormat.NF4: 'nf4'>
    >>> Weights("nf4", compute_dtype="bf16").compute_dtype
    'bfloat16'
    >>> Weights("int4")
    Traceback (most recent call last):
    ...
    ValueError: unknown weights format 'int4'; valid values are 'nf4', 'fp4', 'int8', ...
    """

    format: WeightFormat | None = None
    compute_dtype: str = "float32"
    double_quant: bool = False
    blocksize: int = 64
    quant_storage: str = "uint8"
    int8_threshold: float = 6.0
    skip_modules: tuple[str, ...] | None = None
    group_size: int = 128
    scaler_blocksize: int = NF4_SCALER_BLOCKSIZE

    def __post_init__(self) -> None:
        object.__setattr__(self, "format", weight_format(self.format))
        object.__setattr__(
            self, "compute_dtype", _dtype_name(self.compute_dtype, "compute_dtype", COMPUTE_DTYPES)
        )
        object.__setattr__(
            self, "quant_storage", _dtype_name(self.quant_storage, "quant_storage", QUANT_STORAGES)
        )
        if not isinstance(self.double_quant, bool):
            raise TypeError(f"double_quant must be True or False, got {self.double_quant!r}")
        if self.blocksize not in BLOCKSIZES:
            valid = ", ".join(map(str, BLOCKSIZES))
            raise ValueError(
                f"blocksize must be one of {valid} (bitsandbytes'), got {self.blocksize!r}"
            )
        if self.group_size not in GROUP_SIZES:
            valid = ", ".join(map(str, GROUP_SIZES))
            raise ValueError(
                f"group_size must be one of {valid} (torchao's int4 groups), got "
                f"{self.group_size!r}"
            )
        if not isinstance(self.scaler_blocksize, int) or self.scaler_blocksize < 1:
            raise ValueError(
                "scaler_blocksize must be a positive int (to_nf4's scaler_block_size, "
                f"default {NF4_SCALER_BLOCKSIZE}), got {self.scaler_blocksize!r}"
            )
        if isinstance(self.skip_modules, str):
            object.__setattr__(self, "skip_modules", (self.skip_modules,))
        elif isinstance(self.skip_modules, list):
            object.__setattr__(self, "skip_modules", tuple(self.skip_modules))

    @property
    def quantized(self) -> bool:
        """Whether any weight is quantized."""
        return self.format is not None

    @property
    def torchao(self) -> bool:
        """Whether torchao (not bitsandbytes) quantizes the weights."""
        return self.format in TORCHAO_FORMATS

    @property
    def four_bit(self) -> bool:
        """Whether the weights are ``Linear4bit``'s (nf4 or fp4)."""
        return self.format in (WeightFormat.NF4, WeightFormat.FP4)

    def describe(self) -> str:
        """The setting as one line ("" when not quantized).

        Examples
        --------
        >>> Weights("nf4", double_quant=True, compute_dtype="bf16").describe()
        'nf4 (bitsandbytes Linear4bit, double quantization, blocks of 64, computed in bfloat16)'
        """
        if self.format is None:
            return ""
        if self.format is WeightFormat.INT8_TORCHAO:
            return "int8-torchao (torchao Int8WeightOnlyConfig: Int8Tensor, per output row)"
        if self.format is WeightFormat.INT4_TORCHAO:
            return (
                f"int4-torchao (torchao int4 weight-only, groups of {self.group_size}: "
                "Int4OpaqueTensor on the CPU)"
            )
        if self.format is WeightFormat.NF4_TORCHAO:
            return (
                f"nf4-torchao (torchao NF4Tensor, blocks of {self.blocksize}, scalers in "
                f"int8 blocks of {self.scaler_blocksize}: torchtune's QLoRA)"
            )
        if self.format is WeightFormat.INT8:
            return f"int8 (bitsandbytes Linear8bitLt, outlier threshold {self.int8_threshold})"
        dq = ", double quantization" if self.double_quant else ""
        storage = "" if self.quant_storage == "uint8" else f", stored as {self.quant_storage}"
        return (
            f"{self.format.value} (bitsandbytes Linear4bit{dq}, blocks of {self.blocksize}"
            f"{storage}, computed in {self.compute_dtype})"
        )

    @classmethod
    def from_bnb_config(cls, config: object) -> Weights:
        """The weights a ``transformers.BitsAndBytesConfig`` (or its ``to_dict()``) asks for.

        Examples
        --------
        >>> Weights.from_bnb_config({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        ...     "bnb_4bit_use_double_quant": True, "bnb_4bit_compute_dtype": "bfloat16"})
        Weights(format=<WeightFormat.NF4: 'nf4'>, compute_dtype='bfloat16', double_quant=True, ...)
        """
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        skip = get("llm_int8_skip_modules", None)
        if get("load_in_4bit", False):
            return cls(
                weight_format(get("bnb_4bit_quant_type", "fp4") or "fp4"),
                compute_dtype=get("bnb_4bit_compute_dtype", None) or "float32",
                double_quant=bool(get("bnb_4bit_use_double_quant", False)),
                quant_storage=get("bnb_4bit_quant_storage", None) or "uint8",
                skip_modules=skip,
            )
        if get("load_in_8bit", False):
            threshold = get("llm_int8_threshold", 6.0)
            return cls(WeightFormat.INT8, int8_threshold=float(threshold), skip_modules=skip)
        return cls()


def parse_weights(value: object) -> Weights:
    """``weights=`` as given: None or ``"none"`` (not quantized), a format name (``"nf4"``,
    ``"fp4"``, ``"int8"``, each at ``BitsAndBytesConfig``'s defaults; ``"int8-torchao"``,
    ``"int4-torchao"``, ``"nf4-torchao"`` at torchao's), a :class:`Weights`, or a
    ``transformers.BitsAndBytesConfig``.

    Examples
    --------
    >>> parse_weights("nf4").format.value, parse_weights(None).quantized
    ('nf4', False)
    """
    if isinstance(value, Weights):
        return value
    if value is None or isinstance(value, str | WeightFormat):
        return Weights(weight_format(value))
    if type(value).__name__ == "BitsAndBytesConfig" or isinstance(value, dict):
        return Weights.from_bnb_config(value)
    raise TypeError(
        "weights must be None, 'nf4', 'fp4', 'int8', 'int8-torchao', 'int4-torchao', "
        "'nf4-torchao', a "
        "vram_widget Weights or a "
        f"transformers BitsAndBytesConfig; got {type(value).__name__}"
    )
