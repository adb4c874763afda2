"""GPT-2 table-to-text pipeline: model, loss, weights, tokenizer, data, decoding, metrics."""

import itertools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from text_folder import TEXT_DIR, needs_text_data

from dpmuon_jax.models.common import pure_model
from dpmuon_jax.optimizers import registry
from dpmuon_jax.text import data as text_data
from dpmuon_jax.text import generate, hf_weights, metrics
from dpmuon_jax.text.gpt2 import GPT2, GPT2_SMALL, GPT2Config, gpt2_model, lm_loss, token_nll

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="java is not installed")

TINY = GPT2Config(vocab_size=97, max_positions=16, dim=32, num_layers=2, num_heads=4)


def _model(config=TINY, seed=0, scale=1.0):
  """A tiny GPT-2 whose weights are scaled up so that its logits are far from uniform."""
  apply, params = gpt2_model(GPT2(config, rngs=nnx.Rngs(seed)))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(
      lambda p: jnp.asarray(p + scale * 0.1 * rng.standard_normal(p.shape), jnp.float32), params)
  return apply, params


# ---------------------------------------------------------------- model and loss


def _batch(tokens, mask):
  return {"tokens": jnp.asarray(tokens, jnp.int32), "loss_mask": jnp.asarray(mask, jnp.float32)}


def test_loss_with_padding_equals_unpadded_loss_and_counts_only_target_tokens():
  apply, params = _model()
  loss_fn = jax.jit(lm_loss(apply))
  rng = np.random.default_rng(1)
  # (source length, target length) of two examples, padded to 16 with junk ids.
  shapes = [(4, 3), (6, 8)]
  seqs = [rng.integers(0, TINY.vocab_size, s + t) for s, t in shapes]
  tokens = rng.integers(0, TINY.vocab_size, (2, 16))
  mask = np.zeros((2, 16))
  for i, ((s, t), seq) in enumerate(zip(shapes, seqs)):
    tokens[i, :s + t] = seq
    mask[i, s:s + t] = 1.0

  per_example = []
  for i, ((s, t), seq) in enumerate(zip(shapes, seqs)):
    unpadded = float(loss_fn(params, _batch(seq[None], mask[i:i + 1, :s + t])))
    padded = float(loss_fn(params, _batch(tokens[i:i + 1], mask[i:i + 1])))
    np.testing.assert_allclose(padded, unpadded, rtol=1e-5)
    # By hand: mean over target positions j of −log softmax(logits[j − 1])[x_j].
    logp = np.asarray(jax.nn.log_softmax(apply(params, jnp.asarray(tokens[i:i + 1]))[0]))
    manual = -np.mean([logp[j - 1, seq[j]] for j in range(s, s + t)])
    np.testing.assert_allclose(unpadded, manual, rtol=1e-5)
    per_example.append(unpadded)
  np.testing.assert_allclose(float(loss_fn(params, _batch(tokens, mask))),
                             np.mean(per_example), rtol=1e-5)

  # Changing the ids after the last target changes nothing; changing a target id does.
  changed = tokens.copy()
  changed[0, 7:] = (changed[0, 7:] + 1) % TINY.vocab_size
  np.testing.assert_allclose(float(loss_fn(params, _batch(changed[:1], mask[:1]))),
                             per_example[0], rtol=1e-6)
  changed[0, 5] = (changed[0, 5] + 1) % TINY.vocab_size
  assert abs(float(loss_fn(params, _batch(changed[:1], mask[:1]))) - per_example[0]) > 1e-4

  total, count = token_nll(apply, params, _batch(tokens, mask))
  np.testing.assert_allclose(np.asarray(count), [3, 8])
  np.testing.assert_allclose(np.asarray(total) / np.asarray(count), per_example, rtol=1e-5)


def test_gpt2_small_has_124m_parameters():
  shapes = nnx.state(nnx.eval_shape(lambda: GPT2(GPT2_SMALL, rngs=nnx.Rngs(0))))
  assert sum(x.size for x in jax.tree.leaves(shapes)) == 124_439_808


def test_gpt2_parameter_paths_follow_the_routing_convention():
  from dpmuon_jax.transforms.routing import FALLBACK, MUON, muon_labels

  _, params = _model()
  labels = muon_labels(params, "paper2")
  assert labels["token_embed"]["embedding"] == FALLBACK  # also the tied head
  assert labels["pos_embed"]["embedding"] == FALLBACK
  assert labels["norm"] == {"scale": FALLBACK, "bias": FALLBACK}
  for block in labels["blocks"].values():
    for leaf in ("query", "key", "value", "out"):
      assert block["attn"][leaf] == {"kernel": MUON, "bias": FALLBACK}
    for leaf in ("fc1", "fc2"):
      assert block["mlp"][leaf] == {"kernel": MUON, "bias": FALLBACK}
    assert set(jax.tree.leaves(block["norm1"])) == {FALLBACK}
  assert "head" not in params  # tied: the head is token_embed
  num_muon = sum(1 for x in jax.tree.leaves(labels) if x == MUON)
  assert num_muon == 6 * TINY.num_layers


# ---------------------------------------------------------------- Hugging Face weights


def _perturbed_hf_model(transformers, torch):
  config = transformers.GPT2Config(
      vocab_size=TINY.vocab_size, n_positions=TINY.max_positions, n_embd=TINY.dim,
      n_layer=TINY.num_layers, n_head=TINY.num_heads, resid_pdrop=0.0, embd_pdrop=0.0,
      attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
  torch.manual_seed(0)
  model = transformers.GPT2LMHeadModel(config).eval()
  with torch.no_grad():  # every weight O(0.1-1) so that the logits are not ≈ 0
    for p in model.parameters():
      p.add_(0.2 * torch.randn_like(p))
  return model


def test_forward_matches_hugging_face_gpt2(tmp_path):
  torch = pytest.importorskip("torch", reason="dev extra: needs torch (CPU) for the reference")
  transformers = pytest.importorskip("transformers", reason="dev extra: needs transformers")
  hf = _perturbed_hf_model(transformers, torch)
  hf.save_pretrained(tmp_path)  # safetensors, names prefixed "transformer."
  params, config = hf_weights.load_hf_gpt2(tmp_path)
  assert config == TINY
  apply = pure_model(GPT2(config, rngs=nnx.Rngs(1))).apply
  x = np.random.default_rng(0).integers(0, TINY.vocab_size, (3, TINY.max_positions))
  ours = np.asarray(apply(params, jnp.asarray(x)))
  with torch.no_grad():
    ref = hf(torch.tensor(x)).logits.numpy()
  assert np.std(ref) > 0.5
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=1e-4)


def test_hf_layout_round_trip_and_clear_error_when_absent(tmp_path):
  pytest.importorskip("safetensors", reason="needs the text extra")
  _, params = _model()
  hf_weights.save_hf_gpt2(params, TINY, tmp_path)
  names = set(hf_weights.params_to_hf(params, TINY))
  assert {"wte.weight", "h.1.attn.c_attn.weight", "h.0.mlp.c_proj.bias", "ln_f.weight"} <= names
  loaded, config = hf_weights.load_hf_gpt2(tmp_path)
  assert config == TINY
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
               params, loaded)
  with pytest.raises(FileNotFoundError, match="never downloads"):
    hf_weights.load_hf_gpt2(tmp_path / "missing")


# ---------------------------------------------------------------- private step


def _query_terms(name):
  release = {"l2_clip_norm": 1.0, "noise_multiplier": 1.0, "denominator": 8.0, "key": 0}
  return registry.build(name, 0.02, release, registry.GPT2).query.terms


def _first_with_its_query(names):
  """Each name, marked slow when an earlier name has the very same per-example query (the
  clipping checked below is then that earlier run's; the post-processing on a GPT-2 tree is
  pinned per optimizer by test_conformance.py)."""
  seen = []
  for name in names:
    terms = _query_terms(name)
    yield pytest.param(name, marks=pytest.mark.slow) if terms in seen else name
    seen.append(terms)


def test_only_optimizers_sharing_a_query_run_in_the_slow_job():
  assert _query_terms("dp_muon_bc") is _query_terms("dp_muon")
  distinct = [p for p in _first_with_its_query(registry.names(registry.GPT2))
              if isinstance(p, str)]
  assert {"dp_muon", "dp_disk_muon", "dp_muon_im", "dp_disk_muon_im"} <= set(distinct)


@pytest.mark.parametrize("name", list(_first_with_its_query(registry.names(registry.GPT2))))
def test_private_step_on_tiny_gpt2_clips_each_example_query(name):
  from dpmuon_jax.optimizers.options import Fallback
  from dpmuon_jax.training.step import make_private_step

  c = 0.5
  extra = {"history": 2, "decay": 0.5, "fallback_history": 1, "fallback_decay": 0.5}
  release = {"l2_clip_norm": c, "noise_multiplier": 1.0, "denominator": 8.0,
             "key": jax.random.key(3)}
  opt = registry.build(name, 0.02, release, registry.GPT2,
                       fallback=Fallback(kind="adamw", learning_rate=1e-3),
                       **(extra if name == "dp_muon_im" else {}))
  config = TINY._replace(num_layers=1, dim=16, num_heads=2)
  apply, params = _model(config, scale=3.0)
  step = make_private_step(opt, lm_loss(apply))
  rng = np.random.default_rng(2)
  tokens = rng.integers(0, TINY.vocab_size, (4, 8)).astype(np.int32)
  mask = np.zeros((4, 8), np.float32)
  mask[:, 3:7] = 1.0
  batch = {"tokens": jnp.asarray(tokens), "loss_mask": jnp.asarray(mask)}
  real = jnp.asarray([True, True, True, False])
  state = opt.init(params)
  num_steps = 2  # the second has a history (inner momentum) / a previous release (DiSK)
  for t in range(num_steps):
    if t == num_steps - 1:
      for i in range(3):
        s = step.clipped_sum(params, state, batch, jnp.arange(4) == i)
        norm = np.sqrt(sum(np.sum(np.asarray(x) ** 2) for x in jax.tree.leaves(s.total)))
        assert norm <= c * (1 + 1e-5)
    out = step(params, state, [(batch, real)])
    assert float(out.stats.num_examples) == 3.0
    assert float(out.stats.norm_max) > c  # the bound was active
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(out.params))
    assert not np.allclose(out.params["blocks"][0]["attn"]["query"]["kernel"],
                           params["blocks"][0]["attn"]["query"]["kernel"])
    params, state = out.params, out.opt_state


# ---------------------------------------------------------------- decoding


def _prompts():
  prompts = np.array([[3, 1, 4, 0, 0], [2, 7, 1, 8, 2]], np.int32)
  return jnp.asarray(prompts), jnp.asarray([3, 5], jnp.int32)


def test_greedy_decode_equals_a_python_argmax_loop():
  apply, params = _model(scale=3.0)
  prompts, lengths = _prompts()
  eos, n = 5, 6
  out = generate.greedy_decode(apply, params, prompts, lengths, n, eos)
  fwd = jax.jit(apply)
  for row in range(2):
    seq = np.zeros((1, 5 + n), np.int32)
    length = int(lengths[row])
    seq[0, :length] = prompts[row, :length]
    gen = []
    for step in range(n):
      logits = fwd(params, seq)
      if step == 0:  # the positions argument selects the same logits
        np.testing.assert_allclose(apply(params, seq, jnp.asarray([length - 1]))[0],
                                   logits[0, length - 1], rtol=1e-5, atol=1e-5)
      nxt = int(jnp.argmax(logits[0, length - 1]))
      gen.append(nxt)
      seq[0, length] = nxt
      length += 1
      if nxt == eos:
        break
    k = gen.index(eos) if eos in gen else len(gen)
    assert int(out.lengths[row]) == k
    np.testing.assert_array_equal(np.asarray(out.tokens[row, :k]), gen[:k])
    assert np.all(np.asarray(out.tokens[row, k:]) == eos)


def test_beam_search_is_exhaustive_with_enough_beams_and_greedy_with_one():
  config = TINY._replace(vocab_size=4)
  apply, params = _model(config, seed=4, scale=3.0)
  prompts, lengths = _prompts()
  prompts = prompts % 4
  eos, n, alpha = 3, 3, 0.7

  one = generate.beam_search(apply, params, prompts, lengths, n, eos, 1)
  greedy = generate.greedy_decode(apply, params, prompts, lengths, n, eos)
  np.testing.assert_array_equal(np.asarray(one.tokens), np.asarray(greedy.tokens))

  out = generate.beam_search(apply, params, prompts, lengths, n, eos, 4 ** n, alpha)
  # Every finished hypothesis once: the ids after its end token are eos.
  gens = [g for g in itertools.product(range(4), repeat=n)
          if eos not in g or all(t == eos for t in g[g.index(eos):])]
  for row in range(2):
    prompt = list(np.asarray(prompts[row, :lengths[row]]))
    logp = np.asarray(jax.nn.log_softmax(apply(params, jnp.asarray([prompt + list(g)
                                                                    for g in gens]))))
    scores = []
    for i, g in enumerate(gens):
      k = g.index(eos) + 1 if eos in g else n
      scores.append(sum(logp[i, len(prompt) + j - 1, g[j]] for j in range(k)) / k ** alpha)
    np.testing.assert_array_equal(np.asarray(out.tokens[row]), gens[int(np.argmax(scores))])


# ---------------------------------------------------------------- metrics


def test_bleu_on_hand_computed_multi_reference_example():
  pytest.importorskip("sacrebleu", reason="needs the text extra")
  hyps = ["The Cat sat on the mat", "a dog"]
  refs = [["the cat sat on a mat", "a cat sat on the mat today"], ["A dog"]]
  # Clipped n-gram matches over the corpus: 1-grams (5 + 2)/(6 + 2) ("the" occurs
  # twice but at most once per reference), 2-grams (5 + 1)/(5 + 1), 3-grams 4/4,
  # 4-grams 3/3; hypothesis length 8 = closest reference lengths 6 + 2: no brevity penalty.
  np.testing.assert_allclose(metrics.bleu(hyps, refs), 100 * (7 / 8) ** 0.25, rtol=1e-9)
  # Brevity penalty: 4 of 6 reference words, all precisions 1: BP = exp(1 − 6/4).
  np.testing.assert_allclose(metrics.bleu(["the cat sat on"], [["the cat sat on the mat"]]),
                             100 * np.exp(1 - 6 / 4), rtol=1e-9)


@needs_java
def test_e2e_rouge_l_on_hand_computed_example():
  pytest.importorskip("pycocoevalcap", reason="needs the text extra")
  # PTB tokenization lower-cases and drops "." and ",". Hypothesis "the cat sat"
  # (3 tokens) vs "the cat sat on the mat" (LCS 3: P = 1, R = 1/2) and "a cat sat"
  # (LCS 2: P = 2/3, R = 2/3). P_max = 1, R_max = 2/3; F = (1 + β²) P R / (R + β² P),
  # β = 1.2: 2.44 · (2/3) / (2/3 + 1.44) = 4.88 / 6.32.
  score = metrics.e2e_rouge_l(["The cat sat."], [["the cat sat on the mat .", "A cat, sat"]])
  np.testing.assert_allclose(score, 100 * 4.88 / 6.32, rtol=1e-9)


@needs_java
def test_e2e_rouge_l_equals_the_official_coco_pipeline_on_a_fixture():
  pytest.importorskip("pycocoevalcap", reason="needs the text extra")
  from pycocoevalcap.rouge.rouge import Rouge
  from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

  hyps = ["The Vaults is a pub near Café Adriatic with a 5 star rating.",
          "Blue Spice is a coffee shop in the city centre.",
          "Alimentum isn't family-friendly; it's in the city centre."]
  refs = [["The Vaults pub near Café Adriatic has a 5 star rating . Prices start at £ 30 .",
           "Close to Café Adriatic, The Vaults pub is rated 5 out of 5."],
          ["A coffee shop in the city centre area called Blue Spice ."],
          ["There is a place in the city centre , Alimentum , that is not family - friendly .",
           "Alimentum, in the city centre, is not family friendly.",
           "In the city centre there is a non family-friendly venue called Alimentum."]]
  # e2e-metrics' run_coco_eval: COCOEvalCap tokenizes gts and res separately, then Rouge.
  tok = PTBTokenizer()
  gts = tok.tokenize({i: [{"caption": r} for r in rs] for i, rs in enumerate(refs)})
  res = tok.tokenize({i: [{"caption": h}] for i, h in enumerate(hyps)})
  official, _ = Rouge().compute_score(gts, res)
  assert metrics.e2e_rouge_l(hyps, refs) == pytest.approx(100 * official, abs=1e-12)
  assert 0 < official < 1


def test_dart_rouge_l_jackknifes_over_references():
  pytest.importorskip("rouge_score", reason="needs the text extra")
  # rougeL F1 (rouge-score, stemmed): "the cat sat" vs "the cats sat on the mat":
  # "cats"→"cat", LCS 3, P = 1, R = 1/2, F = 2/3; vs "a dog sat": LCS 1, F = 1/3.
  # Leave-one-out bests: 1/3 (without the first), 2/3 (without the second); mean 1/2.
  score = metrics.dart_rouge_l(["the cat sat"], [["the cats sat on the mat", "a dog sat"]])
  np.testing.assert_allclose(score, 50.0, rtol=1e-9)
  np.testing.assert_allclose(metrics.dart_rouge_l(["a dog sat"], [["a dog sat"]]), 100.0)


def test_mean_token_nll_is_token_weighted_and_results_are_written(tmp_path):
  apply, params = _model()
  rng = np.random.default_rng(5)
  tokens = rng.integers(0, TINY.vocab_size, (5, 10)).astype(np.int32)
  mask = np.zeros((5, 10), np.float32)
  for i, t in enumerate([1, 2, 3, 4, 5]):
    mask[i, 10 - t:] = 1.0
  data = {"tokens": tokens, "loss_mask": mask}
  total, count = token_nll(apply, params, data)
  expected = float(jnp.sum(total) / jnp.sum(count))
  np.testing.assert_allclose(metrics.mean_token_nll(apply, params, data, batch_size=2),
                             expected, rtol=1e-5)
  json_path, csv_path = metrics.write_results(
      {"valid": {"nll": 2.5, "bleu": 60.0}, "test": {"bleu": 61.0}}, tmp_path)
  assert json.load(open(json_path))["valid"] == {"bleu": 60.0, "nll": 2.5}
  assert open(csv_path).read().splitlines() == ["split,bleu,nll", "valid,60.0,2.5",
                                                "test,61.0,"]


# ---------------------------------------------------------------- tokenizer and data


@needs_text_data
def test_tokenizer_ids_match_gpt2():
  pytest.importorskip("tiktoken", reason="needs the text extra")
  from dpmuon_jax.text.tokenizer import GPT2Tokenizer

  tok = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"))
  assert tok.encode("Hello world") == [15496, 995]
  assert tok.vocab_size == 50257 and tok.eos_id == 50256
  assert tok.encode("<|endoftext|>") != [50256]  # never parsed from text
  assert tok.decode(tok.encode(" name : Café | £ 30 ")) == " name : Café | £ 30 "


@needs_text_data
def test_a_changed_bpe_file_at_the_same_path_is_read_again(tmp_path):
  """tiktoken caches the BPE files by path: the tokenizer must not reuse a stale copy."""
  pytest.importorskip("tiktoken", reason="needs the text extra")
  from dpmuon_jax.text.tokenizer import GPT2Tokenizer

  for name in ("vocab.json", "merges.txt"):
    shutil.copy(os.path.join(TEXT_DIR, "gpt2", name), tmp_path / name)
  assert GPT2Tokenizer(tmp_path).encode(" restaurant") == [7072]
  # The first 1,000 merges only: " restaurant" (rank 7,072) is no longer one token.
  merges = (tmp_path / "merges.txt").read_text(encoding="utf-8").splitlines()[:1001]
  (tmp_path / "merges.txt").write_text("\n".join(merges) + "\n", encoding="utf-8")
  vocab = json.loads((tmp_path / "vocab.json").read_text(encoding="utf-8"))
  (tmp_path / "vocab.json").write_text(
      json.dumps({k: v for k, v in vocab.items() if v < 256 + 1000}), encoding="utf-8")
  assert len(GPT2Tokenizer(tmp_path).encode(" restaurant")) > 1


@needs_text_data
def test_the_gpt2_bpe_download_is_checked_against_the_files_the_tests_use(tmp_path, monkeypatch):
  """download_text_data("gpt2") checks OpenAI's files against tiktoken's sha256 sums: those of
  the data folder's copies. A file that differs is removed and refused."""
  import hashlib
  import urllib.request

  for local, (_, sha256) in text_data.GPT2_BPE_FILES.items():
    with open(os.path.join(TEXT_DIR, "gpt2", local), "rb") as f:
      assert hashlib.sha256(f.read()).hexdigest() == sha256, local
  def urlretrieve(url, path):
    with open(path, "wb") as f:
      f.write(b"not GPT-2")

  monkeypatch.setattr(urllib.request, "urlretrieve", urlretrieve)
  with pytest.raises(ValueError, match="encoder.json has sha256"):
    text_data.download_text_data("gpt2", tmp_path)
  assert not (tmp_path / "gpt2" / "vocab.json").exists()


@needs_text_data
def test_e2e_and_dart_loaders_and_encoding(tmp_path):
  pytest.importorskip("tiktoken", reason="needs the text extra")
  from dpmuon_jax.text.tokenizer import GPT2Tokenizer

  e2e = text_data.load_e2e(TEXT_DIR, "dev")
  assert (len(e2e.pairs), len(e2e.groups)) == (4672, 547)
  assert sum(len(g.references) for g in e2e.groups) == 4672
  assert e2e.pairs[0].source.startswith("name : Alimentum | area : city centre")
  assert e2e.pairs[0].target.endswith(" . ")  # the src1 files' trailing space is kept
  assert len(text_data.load_e2e(TEXT_DIR, "test").groups) == 630

  dart = text_data.load_dart(TEXT_DIR, "dev")
  assert (len(dart.pairs), len(dart.groups)) == (6980, 2768)
  assert dart.groups[0].source == ("Mars Hill College : joined : 1973 | Mars Hill College : "
                                   "location : Mars Hill, North Carolina")
  assert len(text_data.load_dart(TEXT_DIR, "test").pairs) == 12551  # one null dropped
  # The official JSON layout (the one DART's train split comes in) loads the same.
  os.makedirs(tmp_path / "dart")
  os.symlink(os.path.abspath(os.path.join(TEXT_DIR, "dart", "dart-v1.1.1-full-dev.json.gz")),
             tmp_path / "dart" / "dart-v1.1.1-full-dev.json.gz")
  assert text_data.load_dart(tmp_path, "dev") == dart
  with pytest.raises(FileNotFoundError, match="download_text_data"):
    text_data.load_dart(tmp_path, "train")

  tok = GPT2Tokenizer(os.path.join(TEXT_DIR, "gpt2"))
  pair = e2e.pairs[0]
  enc = text_data.encode_pairs(tok, [pair], 64)
  src, tgt = text_data.prompt_ids(tok, pair.source), text_data.target_ids(tok, pair.target)
  assert src[-1] == tgt[-1] == 50256
  np.testing.assert_array_equal(enc["tokens"][0, :len(src) + len(tgt)], src + tgt)
  assert enc["loss_mask"][0].sum() == len(tgt)
  np.testing.assert_array_equal(np.flatnonzero(enc["loss_mask"][0]),
                                np.arange(len(src), len(src) + len(tgt)))
  prompts, lengths = text_data.encode_prompts(tok, [pair.source], 64)
  np.testing.assert_array_equal(prompts[0, :lengths[0]], src)
