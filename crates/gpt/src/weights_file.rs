//! Weights as safetensors, with nanoGPT's tensor names and layouts, so a
//! model trained here can be read by anything that reads nanoGPT weights
//! (`lm_head.weight` is tied to `transformer.wte.weight` and stored once).
//!
//! The model shape and the vocabulary go into the file's metadata, so a
//! weights file is all `fsdp-eval` needs.
use std::collections::HashMap;
use std::io::Write;
use std::path::Path;

use safetensors::tensor::{Dtype, SafeTensors, TensorView};

use crate::config::GptConfig;
use crate::error::{GptError, Result};
use crate::params::ParamTable;

const META_KEY: &str = "fsdp_gpt";
const FORMAT: &str = "fsdp-from-scratch/gpt/v1";

/// A model read back from disk: its shape, vocabulary and flat parameters.
#[derive(Debug, Clone)]
pub struct Weights {
    pub cfg: GptConfig,
    pub vocab: String,
    pub flat: Vec<f32>,
}

/// Writes `flat` (table order) to `path` atomically: a temporary file in the
/// same folder, fsync, then rename — a crash leaves the old file or the new
/// one, never half of one.
pub fn save(path: &Path, cfg: &GptConfig, vocab: &str, flat: &[f32]) -> Result<()> {
    let table = ParamTable::new(cfg);
    let bytes: Vec<Vec<u8>> =
        table.specs.iter().map(|s| flat[s.range()].iter().flat_map(|x| x.to_le_bytes()).collect()).collect();
    let views: Vec<(String, TensorView)> = table
        .specs
        .iter()
        .zip(&bytes)
        .map(|(s, b)| (s.name.clone(), TensorView::new(Dtype::F32, s.shape.clone(), b).expect("shape matches bytes")))
        .collect();
    // One metadata key: safetensors writes a HashMap in random order, and
    // equal weights must give byte-identical files.
    let config = serde_json::json!({
        "format": FORMAT,
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_embd": cfg.n_embd,
        "vocab": vocab,
    });
    let meta: HashMap<String, String> = [(META_KEY.to_string(), config.to_string())].into();
    let data = safetensors::serialize(views, Some(meta))
        .map_err(|e| GptError::Weights { path: path.display().to_string(), reason: e.to_string() })?;
    write_atomically(path, &data)
        .map_err(|e| GptError::Weights { path: path.display().to_string(), reason: format!("cannot write it ({e})") })
}

/// Writes `data` to `path` through a temporary file and a rename.
pub fn write_atomically(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp =
        dir.join(format!(".{}.tmp{}", path.file_name().and_then(|n| n.to_str()).unwrap_or("out"), std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Reads a weights file written by [`save`], checking every name, shape and dtype.
pub fn load(path: &Path) -> Result<Weights> {
    let err = |reason: String| GptError::Weights { path: path.display().to_string(), reason };
    let data = std::fs::read(path).map_err(|e| err(format!("cannot read it ({e})")))?;
    let (_, header) = SafeTensors::read_metadata(&data).map_err(|e| err(format!("not a safetensors file ({e})")))?;
    let meta: serde_json::Value = header
        .metadata()
        .as_ref()
        .and_then(|m| m.get(META_KEY))
        .and_then(|v| serde_json::from_str(v).ok())
        .ok_or_else(|| err(format!("no `{META_KEY}` metadata: it was not written by this project")))?;
    let num = |k: &str| -> Result<usize> {
        meta[k].as_u64().map(|v| v as usize).ok_or_else(|| err(format!("metadata has no `{k}`")))
    };
    let cfg = GptConfig {
        vocab_size: num("vocab_size")?,
        block_size: num("block_size")?,
        n_layer: num("n_layer")?,
        n_head: num("n_head")?,
        n_embd: num("n_embd")?,
    };
    let vocab = meta["vocab"].as_str().map(str::to_string).ok_or_else(|| err("metadata has no `vocab`".into()))?;
    if vocab.chars().count() != cfg.vocab_size {
        return Err(err(format!(
            "vocab has {} characters but vocab_size is {}",
            vocab.chars().count(),
            cfg.vocab_size
        )));
    }
    let st = SafeTensors::deserialize(&data).map_err(|e| err(format!("not a safetensors file ({e})")))?;
    let table = ParamTable::new(&cfg);
    let mut flat = vec![0f32; table.numel()];
    for s in &table.specs {
        let t = st.tensor(&s.name).map_err(|_| err(format!("tensor `{}` is missing", s.name)))?;
        if t.dtype() != Dtype::F32 || t.shape() != s.shape.as_slice() {
            return Err(err(format!(
                "tensor `{}` is {:?} {:?}, expected F32 {:?}",
                s.name,
                t.dtype(),
                t.shape(),
                s.shape
            )));
        }
        for (x, b) in flat[s.range()].iter_mut().zip(t.data().chunks_exact(4)) {
            *x = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        }
    }
    Ok(Weights { cfg, vocab, flat })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_every_bit_and_the_names() {
        let cfg = GptConfig::preset("tiny", 65).unwrap();
        let table = ParamTable::new(&cfg);
        let flat = table.init_flat(11);
        let dir = std::env::temp_dir().join(format!("fsdp-ckpt-{}", std::process::id()));
        let path = dir.join("w.safetensors");
        let vocab = crate::data::GENERATED_VOCAB;
        save(&path, &cfg, vocab, &flat).unwrap();
        let w = load(&path).unwrap();
        assert_eq!(w.cfg, cfg);
        assert_eq!(w.vocab, vocab);
        assert_eq!(crate::params::digest_f32(&w.flat), crate::params::digest_f32(&flat));
        let data = std::fs::read(&path).unwrap();
        let st = SafeTensors::deserialize(&data).unwrap();
        assert_eq!(st.tensor("transformer.h.0.attn.c_attn.weight").unwrap().shape(), &[384, 128]);
        assert_eq!(st.len(), table.specs.len());
        // No temporary file left behind.
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        std::fs::write(&path, b"garbage").unwrap();
        assert!(load(&path).unwrap_err().to_string().contains("not a safetensors file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
