"""Which engine builds which model: the one rule for where a model may run.

An engine is offered for a model only when it can build that architecture from that
format. The model's facts (``meshd.models.facts``, ``meshd.models.folder``) offer
engines by it, and placement (fresh plans, repairs, and so the plan check, which runs
``place()`` again) applies it once more to whatever facts it is given, so facts read
by an older meshd (or cached, or sent by an older peer) cannot put a model on an
engine that would fail to load it.

What an engine reads of a file beyond its architecture (the MLX engine's tensor
types, a llama GGUF whose layers hold tensors no llama layer has) is the facts' to
check: only they read the file.
"""

from __future__ import annotations

__all__ = [
    "ENGINES",
    "LLAMA_CPP_ARCHITECTURES",
    "LLAMA_CPP_NO_TEXT",
    "MLX_BATCHED_ARCHITECTURES",
    "MLX_FOLDER_ARCHITECTURES",
    "MLX_GGUF_ARCHITECTURES",
    "MLX_KV_REFUSAL",
    "build_refusal",
    "buildable_engines",
]

#: The engines meshd runs stages with, in the order facts list them.
ENGINES: tuple[str, ...] = ("llama_cpp", "mlx")

#: ``general.architecture`` values llama.cpp builds: llama-arch.cpp's names as gguf-py
#: 0.19 lists them (``gguf.MODEL_ARCH_NAMES``; the llama.cpp of llama-cpp-python 0.3.36
#: holds each of them), less ``clip``, a vision projector llama.cpp refuses as a model.
#: A test ties this list to gguf-py's: when llama-cpp-python moves, move both.
LLAMA_CPP_ARCHITECTURES = frozenset(
    {"afmoe", "apertus", "arcee", "arctic", "arwkv7", "baichuan", "bailingmoe",
     "bailingmoe2", "bert", "bitnet", "bloom", "chameleon", "chatglm", "codeshell",
     "cogvlm", "cohere2", "command-r", "dbrx", "deci", "deepseek", "deepseek2",
     "deepseek2-ocr", "dots1", "dream", "ernie4_5", "ernie4_5-moe", "eurobert", "exaone",
     "exaone-moe", "exaone4", "falcon", "falcon-h1", "gemma", "gemma-embedding",
     "gemma2", "gemma3", "gemma3n", "gemma4", "glm-dsa", "glm4", "glm4moe", "gpt-oss",
     "gpt2", "gptj", "gptneox", "granite", "granitehybrid", "granitemoe", "grok",
     "grovemoe", "hunyuan-dense", "hunyuan-moe", "hunyuan_vl", "internlm2", "jais",
     "jais2", "jamba", "jina-bert-v2", "jina-bert-v3", "kimi-linear", "lfm2", "lfm2moe",
     "llada", "llada-moe", "llama", "llama-embed", "llama4", "maincoder", "mamba",
     "mamba2", "mimo2", "minicpm", "minicpm3", "minimax-m2", "mistral3", "mistral4",
     "modern-bert", "mpt", "nemotron", "nemotron_h", "nemotron_h_moe", "neo-bert",
     "nomic-bert", "nomic-bert-moe", "olmo", "olmo2", "olmoe", "openelm", "orion",
     "paddleocr", "pangu-embedded", "phi2", "phi3", "phimoe", "plamo", "plamo2",
     "plamo3", "plm", "qwen", "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen35",
     "qwen35moe", "qwen3moe", "qwen3next", "qwen3vl", "qwen3vlmoe", "refact", "rnd1",
     "rwkv6", "rwkv6qwen2", "rwkv7", "seed_oss", "smallthinker", "smollm3", "stablelm",
     "starcoder", "starcoder2", "step35", "t5", "t5encoder", "wavtokenizer-dec", "xverse"}
)  # fmt: skip

#: Architectures llama.cpp loads that meshd's llama.cpp stages cannot run, with why:
#: a stage runs a causal decoder (or an encoder, for embeddings) through
#: ``llama_decode``, one step after another. (``t5encoder``, T5's encoder alone, embeds.)
LLAMA_CPP_NO_TEXT = {
    "t5": "an encoder-decoder: llama.cpp runs its encoder with llama_encode, which "
    "meshd's stages never call",
    "wavtokenizer-dec": "an audio codec's decoder: it makes audio features, not text",
    **dict.fromkeys(
        ("dream", "llada", "llada-moe", "rnd1"),
        "a diffusion language model: it fills a block of tokens at once, attending both "
        "ways, not one token after another",
    ),
}

#: GGUF architectures the MLX engine builds: its GGUF path maps llama.cpp's llama
#: tensor names onto mlx-lm's llama model (``meshd.models.mlx_layout``). Mistral,
#: TinyLlama, SmolLM and Llama 2/3 GGUFs all declare ``llama``.
MLX_GGUF_ARCHITECTURES = frozenset({"llama"})

#: ``model_type`` values of a model folder (config.json + safetensors) the MLX engine
#: builds, each with mlx-lm's own model of that type (``meshd.models.folder``; gemma3:
#: the text model of an image-text Gemma 3, whose facts say ``gemma3_text``).
MLX_FOLDER_ARCHITECTURES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3", "gemma3"}
)

#: Architectures whose requests an MLX stage runs together (the ragged batch of
#: ``meshd.engines.mlx_ragged``, which re-implements the blocks of mlx-lm's llama,
#: qwen2, qwen3, phi3 and gemma3_text models, windowed layers included; mlx-lm builds
#: a mistral folder with its llama model, an image-text gemma3 runs its gemma3_text
#: model). Any other runs one request at a time.
MLX_BATCHED_ARCHITECTURES = frozenset(
    {"gemma3", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3"}
)

#: Why an MLX stage is not given a quantized KV cache (``InstanceSpec.kv_cache``): it
#: keeps mlx-lm's f16 cache (its batched path has none other), and a cache type ignored
#: in silence would leave placement budgeting memory the stage does not keep.
MLX_KV_REFUSAL = "MLX stages keep an f16 KV cache, not {kv_cache} (llama_cpp keeps {kv_cache})"

_FORMATS = ("gguf", "mlx")


def build_refusal(engine: str, format: str, architecture: str) -> str | None:
    """Why ``engine`` cannot build a model of ``architecture`` stored as ``format``
    (``gguf``, or ``mlx`` for a model folder), for a person to read; None when it can."""
    if format not in _FORMATS:
        return f"meshd reads no model format {format!r}"
    if engine == "llama_cpp":
        if format != "gguf":
            return "llama.cpp reads GGUF files, not model folders"
        if architecture not in LLAMA_CPP_ARCHITECTURES:
            return f"llama.cpp knows no architecture {architecture!r}"
        why = LLAMA_CPP_NO_TEXT.get(architecture)
        return None if why is None else f"meshd's llama.cpp stages cannot run {architecture}: {why}"
    if engine == "mlx":
        if format == "gguf" and architecture not in MLX_GGUF_ARCHITECTURES:
            return (
                f"MLX reads GGUFs of architecture {', '.join(sorted(MLX_GGUF_ARCHITECTURES))} "
                f"only (its GGUF path maps llama tensors onto mlx-lm's llama model), "
                f"not {architecture!r}: llama_cpp runs it, K-quants included"
            )
        if format == "mlx" and architecture not in MLX_FOLDER_ARCHITECTURES:
            return (
                f"MLX builds model folders of type "
                f"{', '.join(sorted(MLX_FOLDER_ARCHITECTURES))} only, not {architecture!r}"
            )
        return None
    return f"meshd has no engine {engine!r}"


def buildable_engines(format: str, architecture: str) -> list[str]:
    """The engines of :data:`ENGINES` that can build ``architecture`` from ``format``."""
    return [e for e in ENGINES if build_refusal(e, format, architecture) is None]
