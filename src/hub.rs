//! Pretrained weights by name (`--weights imagenet`, `hearth weights fetch resnet50`):
//! torchvision's published ImageNet state_dict of an architecture, downloaded once from its
//! official address into a cache folder and checked against the SHA-256 prefix torchvision
//! puts in the file name (`resnet50-0676ba61.pth`), as `torch.hub` checks it. A file already in
//! PyTorch's own cache (`$TORCH_HOME/hub/checkpoints`) is used where it passes the same check.
//!
//! Offline, the error gives the address and the command that fetches it by hand.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hearth_models::Architecture;

use crate::{HearthError, Result};

/// Where torchvision publishes its weights.
pub const TORCHVISION_URL: &str = "https://download.pytorch.org/models/";

/// The largest file a download may write (VGG-19's is 548 MB).
const MAX_BYTES: u64 = 2 << 30;

/// torchvision's ImageNet weights file of `arch` (its `IMAGENET1K_V1`, the weights the
/// torchvision parity of Hearth's models was checked with).
pub fn imagenet_file(arch: Architecture) -> &'static str {
    use Architecture::*;
    match arch {
        ResNet18 => "resnet18-f37072fd.pth",
        ResNet34 => "resnet34-b627a593.pth",
        ResNet50 => "resnet50-0676ba61.pth",
        ResNet101 => "resnet101-63fe2227.pth",
        ResNet152 => "resnet152-394f9c45.pth",
        Vgg11 => "vgg11-8a719046.pth",
        Vgg11Bn => "vgg11_bn-6002323d.pth",
        Vgg13 => "vgg13-19584684.pth",
        Vgg13Bn => "vgg13_bn-abd245e5.pth",
        Vgg16 => "vgg16-397923af.pth",
        Vgg16Bn => "vgg16_bn-6c64b313.pth",
        Vgg19 => "vgg19-dcbb9e9d.pth",
        Vgg19Bn => "vgg19_bn-c79401a0.pth",
        DenseNet121 => "densenet121-a639ec97.pth",
        DenseNet161 => "densenet161-8d451a50.pth",
        DenseNet169 => "densenet169-b2777c0a.pth",
        DenseNet201 => "densenet201-c1103571.pth",
    }
}

/// Where and how weights are fetched.
#[derive(Debug, Clone)]
pub struct Hub {
    /// The address files are fetched from, ending in `/` ([`TORCHVISION_URL`]; a mirror).
    pub base_url: String,
    /// Where downloaded files are kept.
    pub cache_dir: PathBuf,
    /// PyTorch's cache of the same files, read if it holds one (never written).
    pub torch_cache: Option<PathBuf>,
    /// Connecting, and each wait for more of the body.
    pub timeout: Duration,
}

impl Hub {
    /// torchvision's address; `$HEARTH_CACHE_DIR/weights` or `~/.cache/hearth/weights`;
    /// PyTorch's `$TORCH_HOME/hub/checkpoints` (`~/.cache/torch/...`). `HEARTH_WEIGHTS_URL`
    /// names a mirror.
    pub fn from_env() -> Self {
        let home = std::env::var_os("HOME").map(PathBuf::from);
        let cache_dir = std::env::var_os("HEARTH_CACHE_DIR")
            .map(PathBuf::from)
            .or_else(|| home.as_ref().map(|h| h.join(".cache/hearth")))
            .unwrap_or_else(|| PathBuf::from(".hearth-cache"))
            .join("weights");
        let torch_cache = std::env::var_os("TORCH_HOME")
            .map(PathBuf::from)
            .or_else(|| home.map(|h| h.join(".cache/torch")))
            .map(|t| t.join("hub/checkpoints"));
        let mut base_url =
            std::env::var("HEARTH_WEIGHTS_URL").unwrap_or_else(|_| TORCHVISION_URL.to_string());
        if !base_url.ends_with('/') {
            base_url.push('/');
        }
        Self {
            base_url,
            cache_dir,
            torch_cache,
            timeout: Duration::from_secs(30),
        }
    }

    /// `arch`'s ImageNet weights: the cached file, or downloaded (`progress` gets the bytes so
    /// far and the total where the server says it).
    pub fn imagenet(
        &self,
        arch: Architecture,
        progress: &mut dyn FnMut(u64, Option<u64>),
    ) -> Result<PathBuf> {
        self.fetch(imagenet_file(arch), progress)
    }

    /// The file `name` (torchvision's form, `<name>-<sha256 prefix>.<ext>`) from the cache, or
    /// from `base_url`. A download lands beside its place and is renamed there only once its
    /// hash checks; a download that fails or does not check leaves nothing behind.
    pub fn fetch(&self, name: &str, progress: &mut dyn FnMut(u64, Option<u64>)) -> Result<PathBuf> {
        let expected = hash_prefix(name)?;
        let path = self.cache_dir.join(name);
        let url = format!("{}{name}", self.base_url);
        for cached in
            std::iter::once(path.clone()).chain(self.torch_cache.as_ref().map(|t| t.join(name)))
        {
            if cached.is_file() && sha256_hex(&cached)?.starts_with(expected) {
                return Ok(cached);
            }
        }
        let fail = |reason: String| HearthError::Download {
            url: url.clone(),
            path: path.clone(),
            reason,
        };
        std::fs::create_dir_all(&self.cache_dir).map_err(|e| fail(e.to_string()))?;
        let partial = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
        let got = self
            .download(&url, &partial, progress)
            .and_then(|()| {
                let digest = sha256_hex(&partial).map_err(|e| e.to_string())?;
                if digest.starts_with(expected) {
                    Ok(())
                } else {
                    Err(format!(
                        "the file's SHA-256 is {digest}, its name promises {expected}...: \
                         refused (a damaged or different file)"
                    ))
                }
            })
            .and_then(|()| std::fs::rename(&partial, &path).map_err(|e| e.to_string()));
        if let Err(reason) = got {
            let _ = std::fs::remove_file(&partial);
            return Err(fail(reason));
        }
        Ok(path)
    }

    /// `url`'s body into `to`.
    fn download(
        &self,
        url: &str,
        to: &Path,
        progress: &mut dyn FnMut(u64, Option<u64>),
    ) -> std::result::Result<(), String> {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .timeout_connect(Some(self.timeout))
            .timeout_recv_response(Some(self.timeout))
            .timeout_recv_body(Some(self.timeout))
            .build()
            .into();
        let response = agent.get(url).call().map_err(|e| e.to_string())?;
        let total = response.body().content_length();
        if total.is_some_and(|n| n > MAX_BYTES) {
            return Err(format!("the server announces {} bytes", total.unwrap_or(0)));
        }
        let mut body = response.into_body().into_reader();
        let mut file = std::fs::File::create(to).map_err(|e| e.to_string())?;
        let mut buf = vec![0u8; 1 << 16];
        let mut done = 0u64;
        loop {
            let n = body.read(&mut buf).map_err(|e| e.to_string())?;
            if n == 0 {
                break;
            }
            done += n as u64;
            if done > MAX_BYTES {
                return Err(format!("more than {MAX_BYTES} bytes"));
            }
            file.write_all(&buf[..n]).map_err(|e| e.to_string())?;
            progress(done, total);
        }
        if total.is_some_and(|t| t != done) {
            return Err(format!(
                "the download ended after {done} of {} bytes",
                total.unwrap_or(0)
            ));
        }
        file.sync_all().map_err(|e| e.to_string())
    }
}

/// The SHA-256 prefix in a torchvision file name (`resnet50-0676ba61.pth` -> `0676ba61`).
fn hash_prefix(name: &str) -> Result<&str> {
    name.rsplit_once('-')
        .and_then(|(_, tail)| tail.split('.').next())
        .filter(|h| h.len() >= 6 && h.chars().all(|c| c.is_ascii_hexdigit()))
        .ok_or_else(|| {
            HearthError::InvalidArgument(format!(
                "{name}: not a torchvision weights name (<name>-<sha256 prefix>.pth)"
            ))
        })
}

/// A file's SHA-256 in lower-case hex.
fn sha256_hex(path: &Path) -> Result<String> {
    let io = |source| HearthError::Read {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        ctx.update(&buf[..n]);
    }
    Ok(ctx
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_architecture_has_a_file_whose_name_carries_a_hash() {
        for &arch in Architecture::ALL {
            let name = imagenet_file(arch);
            assert!(name.starts_with(arch.name()), "{arch}: {name}");
            assert_eq!(hash_prefix(name).unwrap().len(), 8, "{name}");
        }
        assert!(hash_prefix("resnet50.pth").is_err());
    }
}
