"""Every knob of a sparrow experiment, once, with a one-line comment each.

An experiment file starts from `get_config()` and overrides what it changes; it never copies this
file. Command-line flags override further: `--config.model.num_heads=4`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.name = 'base'  # run name; the default workdir is runs/<name>
  config.seed = 0  # parameter init, dropout and data order all derive from this

  # Model: the fields of transformer.config.ModelConfig --------------------------------------
  m = config.model = ml_collections.ConfigDict()
  m.family = 'encoder_decoder'  # encoder_decoder | bidirectional_lm | causal_lm
  m.vocab_size = 261  # overwritten by the tokenizer's size at train time
  m.d_model = 512  # residual stream width
  m.num_heads = 8  # query heads
  m.num_kv_heads = ml_collections.FieldReference(None, field_type=int)  # GQA/MQA; None = num_heads
  m.head_dim = ml_collections.FieldReference(None, field_type=int)  # None = d_model // num_heads
  m.d_ff = 2048  # feed-forward hidden width
  m.num_layers = 6  # encoder layers, or the only stack of an LM
  m.num_decoder_layers = ml_collections.FieldReference(None, field_type=int)  # None = num_layers
  m.max_length = 512  # the context: longest sequence (learned positions); data.max_length follows
  m.position = 'sinusoidal'  # sinusoidal | learned | rope | alibi | none
  m.rope_theta = 10000.0  # RoPE base
  m.rope_scaling = 'none'  # none | linear | ntk | yarn | llama3 (RoPE context extension)
  m.rope_scaling_factor = 1.0  # target context / trained context
  m.rope_original_max_length = ml_collections.FieldReference(
    None, field_type=int
  )  # None = max_length
  m.rope_low_freq_factor = 1.0  # llama3 scaling: wavelengths > context / this are interpolated
  m.rope_high_freq_factor = 4.0  # llama3 scaling: wavelengths < context / this are kept
  m.norm = 'layernorm'  # layernorm | rmsnorm | batchnorm (real tokens of the batch; docs/models.md)
  m.norm_eps = 1e-6  # epsilon inside the norm
  m.norm_placement = 'post'  # post (paper) | pre (adds a final norm)
  m.embedding_norm = False  # a norm right after the embeddings (BERT)
  m.residual = True  # residual connections around each sub-layer; False ablates them
  m.activation = 'relu'  # relu | gelu | gelu_tanh | swiglu
  m.use_bias = True  # biases in attention and feed-forward projections
  m.norm_bias = True  # Layer/BatchNorm's bias (False: nanoGPT's bias=False, OLMo); RMSNorm: none
  m.qkv_bias = ml_collections.FieldReference(None, field_type=bool)  # q/k/v biases; None = use_bias
  m.qk_norm = False  # norm over head_dim on queries and keys (Qwen3)
  m.dropout_rate = 0.1  # embeddings and residual branches
  m.attention_dropout_rate = 0.0  # attention probabilities (uses the 'xla' path while training)
  m.ffn_dropout_rate = 0.0  # feed-forward hidden layer
  m.scale_embeddings = True  # multiply embeddings by sqrt(d_model); keep on with sinusoidal
  m.share_embeddings = True  # one table for source and target (EncoderDecoder)
  m.tie_output = True  # output projection = transposed target embedding
  m.attention_scale = True  # 1/sqrt(d_k) scaling of the logits; False = the ablation
  # softmax | linear (phi(q).phi(k), O(T); Katharopoulos et al. 2020) | compressed (own block +
  # mean-pooled other blocks, O(T * (block + T / block)); NSA's compression branch)
  m.attention = 'softmax'
  m.linear_feature_map = 'elu'  # linear attention's phi: elu (elu + 1) | relu | softplus
  m.short_conv = 0  # causal_lm: taps of a depthwise causal conv before self attention (0 = none)
  m.compress_block = 16  # attention='compressed': positions pooled per block (divides rows)
  m.attention_impl = ml_collections.FieldReference(None, field_type=str)  # xla|chunked|pallas|cudnn
  m.attention_chunk_size = 128  # key block of the 'chunked' implementation
  m.window = ml_collections.FieldReference(None, field_type=tuple)  # sliding window (left, right)
  m.init = 'scaled'  # scaled (residual outputs / sqrt(2 * layers)) | plain | large (x sqrt(2L))
  m.init_distribution = 'xavier'  # xavier | normal
  m.init_std = 0.02  # std of 'normal' weights and of unscaled embeddings
  m.type_vocab_size = 0  # token types (BERT: 2)
  m.num_classes = 0  # >0: BidirectionalLM classifies sequences instead of MLM
  m.output_head = True  # False: BidirectionalLM returns hidden states [B, T, D] (HF BertModel)
  m.pad_id = 0  # padding token id (segment ids are derived from it when not given)
  m.dtype = 'float32'  # compute dtype: float32 | bfloat16 | float16
  m.param_dtype = 'float32'  # parameter dtype (keep float32 for mixed precision)
  m.remat = 'none'  # gradient checkpointing per block: none | full | save_matmuls
  m.scan_layers = False  # nn.scan over the blocks (faster compiles)

  # Data: transformer.data.build(config.data, ...) -------------------------------------------
  d = config.data = ml_collections.ConfigDict()
  d.task = 'numbers'  # numbers | grammar | recall (built-in) | text | tsv (files) | tfds | corpus
  d.train_path = ''  # text/tsv: file path or glob; tsv = src<TAB>tgt lines
  d.eval_path = ''  # text/tsv: '' holds out the end of train_path (eval_fraction, or lines)
  # text for the LMs: stream (the file is one running text, cut into rows, as nanoGPT) | lines (a
  # document per line; '' eval_path holds out the last max(64, 1%) lines)
  d.text_format = 'stream'
  d.eval_fraction = 0.1  # text streams: the last this fraction of the tokens is the eval split
  # streams (text, corpus): training rows start at random offsets (nanoGPT) | sequential (every
  # token once an epoch, in order); both are deterministic from the seed and resume exactly
  d.sampling = 'random'
  # corpus: train_path/eval_path are globs of text, .jsonl(.gz/.zst) or Parquet files (prepared
  # once into token shards, then streamed), or of llm.c .bin shards (read in place).
  d.prepared_dir = ''  # corpus: where the token shards are prepared; '' = <workdir>/corpus
  d.prepare_workers = 1  # corpus: processes that tokenise the corpus (experiments.train's prepare)
  d.prepare_chunk_mb = 16  # corpus: MB of plain text per shard (a .gz/.zst file, row group: one)
  d.tokenizer_path = ''  # corpus: an existing SentencePiece .model or HF tokenizer.json to use
  # streams: eval batches from the start of the eval split; 0 = all of it, -1 = all of it up to
  # 4M tokens, else 20
  d.eval_batches = -1
  d.bad_lines = 'error'  # text/tsv/tfds: error | skip (bad UTF-8, columns; counted); blanks skip
  d.tfds_name = 'wmt14_translate/de-en'  # tfds: dataset name, e.g. 'wmt17_translate/de-en', 'lm1b'
  d.tfds_data_dir = ''  # tfds: where datasets are stored; '' = TFDS default (~/tensorflow_datasets)
  d.tfds_train_split = 'train'  # tfds: training split (any TFDS split string, e.g. 'train[:10%]')
  d.tfds_eval_split = 'test'  # tfds: eval split (wmt14 'test' = newstest2014); slice big ones
  d.source_lang = 'en'  # tfds translation: feature used as the source
  d.target_lang = 'de'  # tfds translation: feature used as the target
  d.tfds_text_key = 'text'  # tfds LM datasets: the feature holding the text (lm1b: 'text')
  # byte (261 ids) | char (the text's characters) | sentencepiece (trained) | hf (a model's own)
  d.tokenizer = 'byte'
  d.vocab_size = 32000  # sentencepiece: target vocabulary size (tiny corpora may give fewer)
  d.vocab_multiple = 1  # the model's vocabulary is the tokenizer's rounded up to a multiple of this
  d.spm_train_lines = 1_000_000  # sentencepiece: trains on the first this many training examples
  # LM families: tokens per row; None = model.max_length (set the context once, there); a
  # shorter one trains below the model's context. encoder_decoder ignores it
  d.max_length = ml_collections.FieldReference(None, field_type=int)
  d.max_source_length = 256  # encoder_decoder: source tokens (incl. eos); LM pairs: source part
  d.max_target_length = 256  # encoder_decoder: target tokens (incl. eos)
  d.batch_size = 64  # GLOBAL training batch (rows); each process gets batch_size // process_count
  d.eval_batch_size = 64  # GLOBAL eval batch (rows)
  d.pack = False  # pack several examples per row (segments, positions restart per example)
  # Unpacked training batches are padded to the smallest bucket >= their longest example:
  # True = 8, 16, 32, ... (few shapes, few recompiles), False = always the max, or lengths.
  d.buckets = ml_collections.FieldReference(False, field_type=object)
  d.num_train_examples = 100_000  # numbers/grammar/recall: generated training examples
  d.num_eval_examples = 1_000  # numbers/grammar/recall: generated eval examples
  d.mlm_prob = 0.15  # bidirectional_lm: fraction of tokens masked and predicted
  d.numbers_max = 999_999  # numbers: largest number (>= 1000)
  d.numbers_direction = 'digits_to_words'  # numbers: digits_to_words | words_to_digits
  d.grammar_seed = 0  # grammar: fixes the Markov chain and its documents
  d.grammar_words = 256  # grammar: number of word types
  d.grammar_join = 1  # grammar: documents joined into one example (long rows; extrapolation)
  d.grammar_successors = 0  # grammar: successors of each word (0: 2-6, the default chain)
  d.grammar_holdout = 0.0  # grammar: share of word transitions kept out of training; 0 = off
  # Share of the training examples drawn, over and over, from a subset of repeat_subset examples
  # (repeated data, Hernandez et al. 2022); in [0, 1), 0 = off. Generated and text tasks only.
  d.repeat_fraction = 0.0
  d.repeat_subset = 100
  d.grammar_repeat = 0.0  # grammar: probability that an example is followed by a copy of itself
  d.recall_pairs = 16  # recall: key-value pairs per example (at most 26 distinct keys)
  d.recall_gap = 64  # recall: filler tokens between the pairs and the queries
  d.recall_queries = 8  # recall: queried keys, each followed by its value (<= recall_pairs)
  d.recall_order = 'random'  # recall: query order, random (MQAR) | pairs (a fixed distance back)
  d.recall_filler = 'random'  # recall: filler digits random | constant (all '0')
  d.recall_loss = 'all'  # recall: tokens that carry loss, all | answers (Zoology's: the values)
  d.recall_seed = 0  # recall: fixes the generated examples

  # Objective and training loop ---------------------------------------------------------------
  t = config.train = ml_collections.ConfigDict()
  t.steps = 2000  # optimizer steps in the run
  t.label_smoothing = 0.1  # paper: 0.1; 0 = plain cross-entropy
  t.grad_accum_steps = 1  # micro-batches per step (the data batch is split into this many)
  t.fused_loss = 'auto'  # tied head + loss in vocab chunks, no [B,T,V] logits: auto (CPU)/on/off
  t.loss_chunk_size = 4096  # vocabulary rows per chunk of the fused loss
  t.log_every = 50  # steps between console/TensorBoard scalars
  t.head_entropy_every = 0  # steps between head attention-entropy scalars (TensorBoard); 0 = off
  # Steps between induction telemetry (causal_lm): each head's induction and previous-token
  # scores and the in-context loss, to metrics.jsonl and TensorBoard; 0 = off.
  t.induction_every = 0
  t.eval_every = 500  # steps between evaluations (and at the end)
  t.eval_train_loss = True  # evaluation also scores as many training rows: train_loss beside it
  t.checkpoint_every = 500  # steps between checkpoints (and at the end)
  t.checkpoint_every_seconds = 0.0  # also checkpoint this long after the last save; 0 = off
  t.keep_checkpoints = 3  # how many recent checkpoints to keep
  t.num_samples = 4  # sample outputs printed and logged at each evaluation
  t.eval_decode_examples = 256  # held-out examples decoded for BLEU / exact match (0 = skip)
  t.max_decode_length = 64  # longest greedy decode during evaluation
  t.loss_scale = 2.0**15  # float16 only: initial dynamic loss scale
  t.loss_scale_period = 2000  # float16 only: good steps before the loss scale doubles
  # A step with a NaN/Inf loss or gradient is never applied. Then: skip (go on) | halt (error naming
  # the first non-finite tensor) | rollback (to the last checkpoint, past the batch) | auto.
  t.nonfinite = 'auto'  # auto = skip for float16 (loss scaling), halt otherwise
  t.spike_factor = 0.0  # a loss above this x the running median is a spike, logged; 0 = off
  t.spike_window = 100  # losses in that running median
  t.spike_rollback = False  # a spike also rolls back to the last checkpoint, past its batch

  # Devices: transformer.sharding ----------------------------------------------------------------
  config.mesh = ml_collections.ConfigDict()
  config.mesh.shape = (-1, 1, 1)  # (data, fsdp, tensor) devices; -1 = all devices left over
  # Logical axis -> comma-separated mesh axes ('' = replicated); rules earlier in this list claim
  # their mesh axes first, so activations [batch, length, embed] keep embed whole.
  r = config.mesh.rules = ml_collections.ConfigDict()
  r.batch = 'data,fsdp'  # batch rows: data parallel over both data and fsdp
  r.length = ''  # sequence positions
  r.embed = 'fsdp'  # d_model of weights: FSDP (ZeRO-3) shards parameters and optimizer state
  r.heads = 'tensor'  # attention heads: Megatron-style tensor parallel
  r.kv_heads = 'tensor'  # key/value heads (GQA/MQA): must divide by the tensor size
  r.kv = ''  # head_dim
  r.mlp = 'tensor'  # feed-forward hidden units: tensor parallel
  r.vocab = 'tensor'  # embedding rows and logits: tensor parallel (see data.vocab_multiple)
  r.layers = ''  # the stacked layer axis of scan_layers

  # Optimizer and schedule: transformer.training.optim ------------------------------------
  o = config.optim = ml_collections.ConfigDict()
  o.optimizer = 'adam'  # adam | adamw (decay masks out norms and biases)
  o.learning_rate = 1.0  # peak LR; for 'rsqrt' a multiplier of d_model^-0.5 * min(...)
  o.schedule = 'rsqrt'  # rsqrt | warmup_cosine | cosine_restarts | constant | linear
  o.warmup_steps = 4000  # linear warmup steps (paper: 4000)
  o.end_learning_rate_factor = 0.0  # cosine/linear: final LR as a fraction of the peak
  o.restart_period = 1000  # cosine_restarts: steps per cycle
  o.b1 = 0.9  # Adam beta1 (paper)
  o.b2 = 0.98  # Adam beta2 (paper)
  o.eps = 1e-9  # Adam epsilon (paper)
  o.weight_decay = 0.0  # adamw only
  o.clip_norm = 0.0  # global gradient-norm clipping; 0 = off
  return config
