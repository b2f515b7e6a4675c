//! Weights by name (`hearth::hub`, `--weights imagenet`) against a server on 127.0.0.1 that
//! serves a fixture: a good download lands in the cache once and is then read from it; a
//! corrupt or cut-short one is refused and leaves nothing behind; offline, the error gives the
//! address and the command that fetches it by hand. No test reaches beyond 127.0.0.1.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hearth::hub::Hub;

/// What the server answers for every request.
#[derive(Clone, Copy)]
enum Answer {
    /// The body, whole.
    Whole,
    /// A Content-Length 100 bytes longer than the body it sends before closing.
    CutShort,
    /// 404.
    Missing,
}

/// Serves `body` per `answer` on 127.0.0.1 until the test ends; the address and the number of
/// requests served.
fn serve(body: Vec<u8>, answer: Answer) -> (String, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let served = Arc::new(AtomicUsize::new(0));
    let count = served.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut line = String::new();
            // The request line and headers, up to the blank line.
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) {
                if line == "\r\n" {
                    break;
                }
                line.clear();
            }
            count.fetch_add(1, Ordering::SeqCst);
            let head = match answer {
                Answer::Whole => format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n", body.len()),
                Answer::CutShort => format!(
                    "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n",
                    body.len() + 100
                ),
                Answer::Missing => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n".into(),
            };
            let _ = stream.write_all(format!("{head}Connection: close\r\n\r\n").as_bytes());
            if !matches!(answer, Answer::Missing) {
                let _ = stream.write_all(&body);
            }
        }
    });
    (format!("http://{addr}/"), served)
}

fn sha256_prefix(bytes: &[u8]) -> String {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .iter()
        .take(4)
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn hub(base_url: &str, cache: &Path) -> Hub {
    Hub {
        base_url: base_url.to_string(),
        cache_dir: cache.join("weights"),
        torch_cache: Some(cache.join("torch")),
        timeout: Duration::from_secs(5),
    }
}

/// Files in the cache folder (a refused download leaves none, not even a partial one).
fn cached(cache: &Path) -> Vec<String> {
    std::fs::read_dir(cache.join("weights"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn a_download_is_checked_kept_and_then_read_from_the_cache() {
    let fixture = std::fs::read(common::fixture("resnet_basic.pth")).unwrap();
    let name = format!("resnet_basic-{}.pth", sha256_prefix(&fixture));
    let (url, served) = serve(fixture.clone(), Answer::Whole);
    let dir = tempfile::tempdir().unwrap();
    let hub = hub(&url, dir.path());
    let mut seen = Vec::new();
    let path = hub
        .fetch(&name, &mut |done, total| seen.push((done, total)))
        .unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), fixture);
    assert_eq!(path, dir.path().join("weights").join(&name));
    let total = fixture.len() as u64;
    assert_eq!(
        seen.last(),
        Some(&(total, Some(total))),
        "progress: {seen:?}"
    );
    assert_eq!(cached(dir.path()), std::slice::from_ref(&name));
    // The second time from the cache: the server is not asked again.
    hub.fetch(&name, &mut |_, _| {}).unwrap();
    assert_eq!(served.load(Ordering::SeqCst), 1);
    // The file loads as torchvision weights.
    let mut model = common::fixture_config("resnet_basic")
        .init(&burn::prelude::Device::flex())
        .unwrap();
    hearth::models::load_torchvision(&mut model, &path, &Default::default()).unwrap();

    // A file PyTorch's cache already holds is used as it is.
    let other = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(other.path().join("torch")).unwrap();
    std::fs::write(other.path().join("torch").join(&name), &fixture).unwrap();
    let offline = hub_offline(other.path());
    let found = offline.fetch(&name, &mut |_, _| {}).unwrap();
    assert_eq!(found, other.path().join("torch").join(&name));
}

/// A hub whose address has nothing listening.
fn hub_offline(cache: &Path) -> Hub {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    hub(&format!("http://127.0.0.1:{port}/"), cache)
}

#[test]
fn corrupt_cut_short_missing_and_offline_downloads_are_refused_and_leave_nothing() {
    let fixture = std::fs::read(common::fixture("resnet_basic.pth")).unwrap();
    let name = format!("resnet_basic-{}.pth", sha256_prefix(&fixture));
    let mut damaged = fixture.clone();
    damaged[1000] ^= 0xff;
    for (body, answer, why) in [
        (damaged, Answer::Whole, "SHA-256"),
        (fixture.clone(), Answer::CutShort, ""),
        (Vec::new(), Answer::Missing, "404"),
    ] {
        let (url, _) = serve(body, answer);
        let dir = tempfile::tempdir().unwrap();
        let e = hub(&url, dir.path())
            .fetch(&name, &mut |_, _| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("{url}{name}")) && e.contains(why),
            "{e}"
        );
        assert!(e.contains("curl -L -o"), "{e}");
        assert!(cached(dir.path()).is_empty(), "{:?}", cached(dir.path()));
    }
    let dir = tempfile::tempdir().unwrap();
    let e = hub_offline(dir.path())
        .fetch(&name, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot download http://127.0.0.1:"), "{e}");
    assert!(cached(dir.path()).is_empty());
    assert!(
        hub_offline(dir.path())
            .fetch("resnet50.pth", &mut |_, _| {})
            .is_err()
    );
}

#[test]
fn weights_imagenet_on_the_command_line_fetches_by_name_and_says_where_offline() {
    let dir = tempfile::tempdir().unwrap();
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let hearth = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_hearth"))
            .args(args)
            .env("HEARTH_WEIGHTS_URL", format!("http://127.0.0.1:{port}"))
            .env("HEARTH_CACHE_DIR", dir.path())
            .env("TORCH_HOME", dir.path().join("torch"))
            .output()
            .unwrap()
    };
    // A dry run names the file and downloads nothing.
    let out = hearth(&[
        "train",
        "--model",
        "resnet18",
        "--weights",
        "imagenet",
        "--dry-run",
    ]);
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("resnet18-f37072fd.pth"), "{text}");
    assert!(!dir.path().join("weights").exists());
    // Offline: the address of torchvision's file and how to fetch it by hand.
    let out = hearth(&["weights", "fetch", "resnet18"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains(&format!("http://127.0.0.1:{port}/resnet18-f37072fd.pth"))
            && err.contains("curl -L -o"),
        "{err}"
    );
    let out = hearth(&["weights", "fetch", "resnet19"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown model 'resnet19'"));
}
