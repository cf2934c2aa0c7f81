"""tutorial_lib: the finished parts of the Transformers-from-scratch notebooks.

Each module holds one idea; later notebooks import what earlier notebooks built. The modules,
grouped as the course uses them (the README's section "The package" has the same table):

| group                 | module               | holds                                                                 |
|-----------------------|----------------------|-----------------------------------------------------------------------|
| parts of a block      | `masks.py`           | building, combining and converting masks (True = may attend)          |
|                       | `attention.py`       | attention written out and fused; multi-head, grouped-query, KV cache  |
|                       | `positions.py`       | sinusoidal, learned, rotary (RoPE), ALiBi, T5's relative bias         |
|                       | `layers.py`          | feed-forward variants, norms, pre-/post-LN blocks, embeddings, init   |
|                       | `moe.py`             | mixture-of-experts feed-forward: router, experts, balance loss        |
| models                | `config.py`          | the frozen ModelConfig a model is built from, and named presets       |
|                       | `transformer.py`     | the encoder, the decoder and the encoder-decoder model                |
|                       | `encoder_only.py`    | BERT-style backbone and heads: masked LM, classification              |
|                       | `gpt.py`             | the decoder-only language model, GPT or LLaMA flavour                 |
| decoding              | `sampling.py`        | greedy, temperature, top-k, top-p, beam search; generate, chat        |
|                       | `fast_decode.py`     | the fused one-token step, used only with generate(fast=True)          |
| real checkpoints      | `bpe.py`             | byte-level BPE: pre-tokenisation, encoding, decoding, training        |
|                       | `tokenizer_files.py` | tokenizer files: GPT-2's, tokenizer.json, tiktoken ranks, GGUF        |
|                       | `chat.py`            | chat templates rendered as transformers does, with message spans      |
|                       | `hf_config.py`       | Hugging Face config.json files read into a ModelConfig                |
|                       | `convert.py`         | weight maps from torch.nn, transformers and GGUF into our models      |
|                       | `gguf.py`            | the GGUF format read from scratch; dequantization of its blocks       |
|                       | `pretrained.py`      | real checkpoints (safetensors or GGUF, folder or Hub) into our models |
|                       | `gguf_write.py`      | a course LLaMA-style model and its tokenizer written to a GGUF file   |
| a model on a laptop   | `quant.py`           | integer quantization by hand; ggml's Q8_0/Q4_0/Q4_1 blocks, exactly   |
|                       | `quant_linear.py`    | linear layers on quantized weights: int4/int8 kernels, frozen blocks  |
|                       | `memory_bound.py`    | bytes a decoding step reads, memory bandwidth, a weight layout        |
|                       | `speculative.py`     | speculative decoding: prompt-lookup drafts, exact verification        |
| an assistant          | `lora.py`            | LoRA from scratch: wrap, freeze, count, merge; on quantized bases too |
|                       | `sft.py`             | chat data with a loss on the assistant's tokens only; date answers    |
|                       | `dpo.py`             | direct preference optimisation: the loss, preference pairs            |
| training              | `data.py`            | character tokenizer, the built-in corpus, LM batches, padding         |
|                       | `dates.py`           | the date-normalisation task of notebooks 05, 06a, 08 and 12           |
|                       | `train.py`           | schedules, AdamW groups, label smoothing, the training loop           |
|                       | `gpu_loop.py`        | train()'s steps on a CUDA GPU, read back every few steps              |
|                       | `checkpoint.py`      | atomic checkpoints that resume a run exactly                          |
| scale                 | `ddp.py`             | data-parallel training with DDP, one process or several               |
|                       | `parallel.py`        | FSDP2, tensor- and pipeline-parallel plans on PyTorch's APIs          |
|                       | `parallel_runs.py`   | the two-process runs of notebook 10                                   |
|                       | `parallel_by_hand.py` | collectives and column/row-parallel layers by hand (notebook 10) |
| counting              | `params.py`          | exact parameter counts, memory and FLOPs from a config                |
| what the learner sees | `plotting.py`        | the figures: heatmaps, masks, positions, probes, curves               |
|                       | `widgets.py`         | interactive explorers, with a static figure where widgets cannot run  |
|                       | `probes.py`          | leakage and padding-isolation probes, on any model                    |
|                       | `norm_order.py`      | pre-LN against post-LN: gradients at initialisation, a warmup sweep   |
|                       | `heads.py`           | scores of attention heads (previous-token, induction)                 |
|                       | `exercises/`         | the graded exercises, one module per notebook, on a shared core       |
| under it all          | `checks.py`          | the shared argument checks: one place, specific messages              |
|                       | `device.py`          | device choice, seeding, precision and settings per device             |
|                       | `project.py`         | the repository's address, the Colab set-up, the bundled model         |
"""

__version__ = "0.1.0"
