//! Data: the generated default corpus, the character vocabulary, and the
//! sampler whose batches never depend on the number of ranks.
//!
//! ## The world-size-invariant batch
//! Step `s` trains on a *global batch* of `M` micro-batches, each `B`
//! sequences of `T` tokens. Which sequences they are depends only on
//! `(seed, s)`. Rank `r` of `N` takes micro-batches `r·M/N .. (r+1)·M/N`, a
//! contiguous share, so 1, 2 or 4 ranks train on exactly the same tokens.
use std::ops::Range;

use candle_core::{Device, Tensor};

use crate::error::{GptError, Result};
use crate::rng::SplitMix64;

/// A text and its character-level tokenisation.
#[derive(Debug, Clone)]
pub struct Corpus {
    /// Where the text came from (a path or `generated`), for messages.
    pub source: String,
    /// The distinct characters, sorted; a token is an index into this.
    pub vocab: Vec<char>,
    pub tokens: Vec<u32>,
}

/// The character set of Shakespeare's plays in nanoGPT's `shakespeare_char`
/// (65 characters); the generated corpus uses exactly these, so the `tiny`
/// model has the classic toy's 809,856 parameters.
pub const GENERATED_VOCAB: &str = "\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

impl Corpus {
    /// The default corpus: a play generated from a small grammar, about 256 KiB,
    /// the same bytes on every machine. Its structure (speaker names, a limited
    /// vocabulary of words, verse-like lines) lets a 0.8M-parameter model
    /// bring the loss far below ln(65) ≈ 4.17 within a few hundred steps.
    pub fn generated() -> Self {
        Self::from_text("generated", &generate_play(256 * 1024)).expect("generated text is valid")
    }

    /// The generated corpus's vocabulary, as characters.
    pub fn generated_vocab() -> Vec<char> {
        GENERATED_VOCAB.chars().collect()
    }

    /// Reads a UTF-8 text file; every distinct character becomes a token.
    pub fn from_file(path: &str) -> Result<Self> {
        let err = |reason: String| GptError::Data { path: path.to_string(), reason };
        let bytes = std::fs::read(path)
            .map_err(|e| err(format!("cannot read it ({e}); pass --data with a readable text file")))?;
        let text = String::from_utf8(bytes).map_err(|e| {
            err(format!("not UTF-8 (invalid byte at offset {}); pass a UTF-8 text file", e.utf8_error().valid_up_to()))
        })?;
        Self::from_text(path, &text)
    }

    pub fn from_text(source: &str, text: &str) -> Result<Self> {
        if text.is_empty() {
            return Err(GptError::Data {
                path: source.into(),
                reason: "is empty; pass a text file with some content".into(),
            });
        }
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        vocab.shrink_to_fit(); // else it keeps the whole text's capacity: 4 bytes per character, or more

        let mut tokens = encode_with(&vocab, text).expect("every char is in its own vocabulary");
        tokens.shrink_to_fit(); // collected from `chars()`, it may have grown to twice its length
        Ok(Self { source: source.to_string(), vocab, tokens })
    }

    /// Tokenises `text` with this corpus's vocabulary (for evaluating a model
    /// on another text); fails on a character the model has never seen.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        encode_with(&self.vocab, text).map_err(|c| GptError::Data {
            path: self.source.clone(),
            reason: format!("character {c:?} is not in the model's vocabulary"),
        })
    }

    pub fn vocab_string(&self) -> String {
        self.vocab.iter().collect()
    }
}

fn encode_with(vocab: &[char], text: &str) -> std::result::Result<Vec<u32>, char> {
    text.chars().map(|c| vocab.binary_search(&c).map(|i| i as u32).map_err(|_| c)).collect()
}

/// One micro-batch: inputs and next-token targets, (B, T) each.
#[derive(Debug, Clone)]
pub struct Batch {
    pub inputs: Tensor,
    pub targets: Tensor,
}

/// Cuts global batches out of a token stream, as a pure function of `(seed, step)`.
#[derive(Debug, Clone)]
pub struct Sampler {
    tokens: Vec<u32>,
    /// Sequences per micro-batch, B.
    pub batch_size: usize,
    /// Tokens per sequence, T.
    pub seq_len: usize,
    /// Micro-batches per step, M (the global batch is M·B·T tokens).
    pub micro_batches: usize,
    pub seed: u64,
}

impl Sampler {
    /// Fails when the text is too short for even one sequence of `seq_len + 1` tokens.
    pub fn new(corpus: &Corpus, batch_size: usize, seq_len: usize, micro_batches: usize, seed: u64) -> Result<Self> {
        if corpus.tokens.len() < seq_len + 2 {
            return Err(GptError::Data {
                path: corpus.source.clone(),
                reason: format!(
                    "has {} characters, fewer than the {} one sequence needs; pass a longer text or a smaller --seq-len",
                    corpus.tokens.len(),
                    seq_len + 2
                ),
            });
        }
        Ok(Self { tokens: corpus.tokens.clone(), batch_size, seq_len, micro_batches, seed })
    }

    /// Tokens in one step's global batch (M·B·T), the same at every world size.
    pub fn tokens_per_step(&self) -> usize {
        self.micro_batches * self.batch_size * self.seq_len
    }

    /// The micro-batches rank `rank` of `world` trains on: a contiguous share.
    /// The caller checks that `world` divides M.
    pub fn share(&self, rank: usize, world: usize) -> Range<usize> {
        let per = self.micro_batches / world;
        rank * per..(rank + 1) * per
    }

    /// The start offsets of all sequences of `step`'s global batch, in order.
    pub fn offsets(&self, step: u64) -> Vec<usize> {
        let mut rng = SplitMix64::for_stream(self.seed ^ 0x5A17_DA7A, step);
        let span = (self.tokens.len() - self.seq_len - 1) as u64;
        (0..self.micro_batches * self.batch_size).map(|_| rng.below(span) as usize).collect()
    }

    /// Micro-batch `k` (0 ≤ k < M) of `step`'s global batch.
    pub fn micro_batch(&self, step: u64, k: usize) -> Result<Batch> {
        let (b, t) = (self.batch_size, self.seq_len);
        let offsets = &self.offsets(step)[k * b..(k + 1) * b];
        let mut x = Vec::with_capacity(b * t);
        let mut y = Vec::with_capacity(b * t);
        for &o in offsets {
            x.extend_from_slice(&self.tokens[o..o + t]);
            y.extend_from_slice(&self.tokens[o + 1..o + t + 1]);
        }
        Ok(Batch {
            inputs: Tensor::from_vec(x, (b, t), &Device::Cpu)?,
            targets: Tensor::from_vec(y, (b, t), &Device::Cpu)?,
        })
    }
}

/// Writes a play of at least `min_len` bytes from a fixed grammar and a fixed
/// seed. Everything a character model can learn is here: names in capitals
/// followed by a colon, a closed set of words, sentence shapes, punctuation.
fn generate_play(min_len: usize) -> String {
    const NAMES: [&str; 12] = [
        "KING HENRY",
        "QUEEN",
        "DUKE VINCENTIO",
        "LADY MACBETH",
        "JULIET",
        "FALSTAFF",
        "ROSALIND",
        "OBERON",
        "PROSPERO",
        "OPHELIA",
        "BRUTUS",
        "PUCK",
    ];
    const SUBJECTS: [&str; 14] = [
        "the king",
        "my lord",
        "thy father",
        "the queen",
        "this night",
        "our fortune",
        "a jester",
        "the quiet sky",
        "your majesty",
        "the zealous knave",
        "his jewel",
        "the old oxen",
        "my gentle friend",
        "the wax of love",
    ];
    const VERBS: [&str; 14] = [
        "doth love",
        "shall keep",
        "hath seen",
        "will betray",
        "must follow",
        "cannot quit",
        "did vex",
        "would praise",
        "may judge",
        "dost fear",
        "hath kissed",
        "shall wake",
        "will mend",
        "doth query",
    ];
    const OBJECTS: [&str; 14] = [
        "the crown",
        "my heart",
        "thy sweet words",
        "the golden field",
        "a quarrel",
        "the dark wood",
        "our honour",
        "the frozen lake",
        "a noble cause",
        "her velvet glove",
        "the brave army",
        "my joy",
        "the lazy hours",
        "this lonely grave",
    ];
    const ENDINGS: [&str; 8] =
        ["", " to-morrow", " in faith", " for ever", " and more", " tonight", " no more", " once"];
    const MARKS: [&str; 5] = [".", ".", "!", "?", ";"];
    let mut rng = SplitMix64::new(0x5EED_7EA7);
    let mut pick = |n: usize| rng.below(n as u64) as usize;
    // The preamble names every character of the vocabulary at least once.
    let mut out = String::from("ACT 3, SCENE 3. A hall; KING & QUEEN: 'What? $3 -- no!' Enter XERXES, ZEUS.\n\n");
    while out.len() < min_len {
        out.push_str(NAMES[pick(NAMES.len())]);
        out.push_str(":\n");
        for _ in 0..1 + pick(3) {
            let s = SUBJECTS[pick(SUBJECTS.len())];
            let mut line = format!(
                "{} {} {}{}",
                s,
                VERBS[pick(VERBS.len())],
                OBJECTS[pick(OBJECTS.len())],
                ENDINGS[pick(ENDINGS.len())]
            );
            if pick(4) == 0 {
                line.push_str(", and ");
                line.push_str(SUBJECTS[pick(SUBJECTS.len())]);
                line.push(' ');
                line.push_str(VERBS[pick(VERBS.len())]);
                line.push(' ');
                line.push_str(OBJECTS[pick(OBJECTS.len())]);
            }
            line.push_str(MARKS[pick(MARKS.len())]);
            let mut cs = line.chars();
            let first = cs.next().expect("lines are never empty").to_ascii_uppercase();
            out.push(first);
            out.push_str(cs.as_str());
            out.push('\n');
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_corpus_is_fixed_large_and_has_the_shakespeare_vocabulary() {
        let c = Corpus::generated();
        assert!(c.tokens.len() >= 200 * 1024);
        assert_eq!(c.vocab_string(), GENERATED_VOCAB);
        assert_eq!(
            crate::params::digest_f32(&c.tokens.iter().map(|&t| t as f32).collect::<Vec<_>>()),
            crate::params::digest_f32(&Corpus::generated().tokens.iter().map(|&t| t as f32).collect::<Vec<_>>())
        );
    }

    #[test]
    fn every_world_size_trains_on_the_same_tokens() {
        let c = Corpus::generated();
        let s = Sampler::new(&c, 4, 16, 12, 42).unwrap();
        let all = |world: usize| -> Vec<u32> {
            (0..world)
                .flat_map(|r| s.share(r, world))
                .flat_map(|k| s.micro_batch(7, k).unwrap().inputs.flatten_all().unwrap().to_vec1::<u32>().unwrap())
                .collect()
        };
        let one = all(1);
        assert_eq!(one.len(), 12 * 4 * 16);
        for world in [2, 3, 4, 6, 12] {
            assert_eq!(all(world), one, "world {world}");
        }
        assert_ne!(s.offsets(7), s.offsets(8), "steps differ");
    }

    #[test]
    fn targets_are_inputs_shifted_by_one() {
        let c = Corpus::from_text("t", "abcdefghij").unwrap();
        let s = Sampler::new(&c, 2, 4, 1, 1).unwrap();
        let b = s.micro_batch(0, 0).unwrap();
        let x = b.inputs.to_vec2::<u32>().unwrap();
        let y = b.targets.to_vec2::<u32>().unwrap();
        for (xr, yr) in x.iter().zip(&y) {
            assert_eq!(&xr[1..], &yr[..3]);
            assert_eq!(yr[3], xr[3] + 1); // letters are consecutive tokens here
        }
    }

    #[test]
    fn bad_text_is_rejected_with_a_reason() {
        assert!(Corpus::from_text("e", "").unwrap_err().to_string().contains("empty"));
        let c = Corpus::from_text("s", "abc").unwrap();
        let e = Sampler::new(&c, 1, 8, 1, 0).unwrap_err().to_string();
        assert!(e.contains("fewer than the 10"), "{e}");
        // A name of this process's own: another user's file of a fixed name may sit in /tmp.
        let p = std::env::temp_dir().join(format!("fsdp-not-utf8-{}.txt", std::process::id()));
        std::fs::write(&p, [0x61, 0xff, 0x62]).unwrap();
        let e = Corpus::from_file(p.to_str().unwrap()).unwrap_err().to_string();
        std::fs::remove_file(&p).unwrap();
        assert!(e.contains("not UTF-8 (invalid byte at offset 1)"), "{e}");
    }
}
