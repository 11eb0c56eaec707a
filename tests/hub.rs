//! Models by Hugging Face id, with no internet: a small hub served on loopback by the test
//! (revision info, `resolve` with ETag / X-Repo-Commit / redirects to a CDN path, Range requests)
//! holding the tiny MLX fixture checkpoint. The real `lily` binary downloads from it into a
//! temporary HF cache, runs offline from that cache, resumes a dropped download, and reports
//! 404s, 401s and repositories of other models clearly.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

fn fixture() -> PathBuf {
    let root = std::env::var_os("LILY_REPO").map(PathBuf::from).unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    root.join("tests/fixtures/tiny-mlx4")
}

fn sha256(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

struct File {
    name: String,
    data: Vec<u8>,
    lfs: bool,
}

struct Repo {
    commit: String,
    files: Vec<File>,
    /// Some: the token a request must carry (a gated repository).
    token: Option<String>,
}

#[derive(Default)]
struct State {
    repos: HashMap<String, Repo>,
    /// The next body download sends this many bytes, then drops the connection.
    drop_after: Option<usize>,
    /// Request lines and their Range headers, in order.
    log: Vec<String>,
    /// The revision info lists a wrong sha256 for LFS files (what arrives is then "corrupt").
    wrong_sha: bool,
}

struct Hub {
    addr: String,
    state: Arc<Mutex<State>>,
}

/// The tiny MLX checkpoint as a repository (plus files lily must not fetch).
fn tiny_repo(commit: &str, token: Option<&str>, model_type: Option<&str>) -> Repo {
    let mut files = Vec::new();
    for name in [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "README.md",
    ] {
        let mut data = std::fs::read(fixture().join(name)).unwrap();
        if let (Some(t), "config.json") = (model_type, name) {
            let mut v: Value = serde_json::from_slice(&data).unwrap();
            v["model_type"] = json!(t);
            v["text_config"]["model_type"] = json!(t);
            data = serde_json::to_vec(&v).unwrap();
        }
        files.push(File { name: name.into(), lfs: name.ends_with(".safetensors"), data });
    }
    files.push(File { name: "model-q4.gguf".into(), data: vec![7; 1000], lfs: true });
    files.push(File { name: "original/model.safetensors".into(), data: vec![1; 100], lfs: true });
    Repo { commit: commit.into(), files, token: token.map(str::to_string) }
}

fn respond(s: &mut TcpStream, status: &str, headers: &[(String, String)], body: &[u8], send: Option<usize>) {
    let mut h = format!("HTTP/1.1 {status}\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    let _ = s.write_all(h.as_bytes());
    let _ = s.write_all(&body[..send.unwrap_or(body.len()).min(body.len())]);
    let _ = s.flush();
}

fn json_err(s: &mut TcpStream, status: &str, code: &str, msg: &str) {
    let h = vec![("X-Error-Code".into(), code.into()), ("X-Error-Message".into(), msg.into())];
    respond(s, status, &h, json!({"error": msg}).to_string().as_bytes(), None);
}

fn handle(mut s: TcpStream, addr: &str, state: &Mutex<State>) {
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut line = String::new();
    if r.read_line(&mut line).is_err() {
        return;
    }
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).unwrap_or(0) == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
    let range = headers.get("range").cloned();
    let mut st = state.lock().unwrap();
    st.log.push(format!("{} {}", path, range.clone().unwrap_or_default()));
    let auth = headers.get("authorization").cloned();
    let path_only = path.split('?').next().unwrap_or("").to_string();
    // Serves a byte range of `data` (206) or all of it (200).
    let serve = |s: &mut TcpStream, data: &[u8], mut extra: Vec<(String, String)>, drop: Option<usize>| {
        let (a, b) = match range.as_deref().and_then(|r| r.strip_prefix("bytes=")).and_then(|r| r.split_once('-')) {
            Some((a, b)) => {
                let a: usize = a.parse().unwrap_or(0);
                let b: usize = if b.is_empty() { data.len() - 1 } else { b.parse().unwrap_or(data.len() - 1) };
                (a, b.min(data.len() - 1))
            }
            None => (0, data.len() - 1),
        };
        extra.push(("Content-Range".into(), format!("bytes {a}-{b}/{}", data.len())));
        extra.push(("Accept-Ranges".into(), "bytes".into()));
        respond(s, if range.is_some() { "206 Partial Content" } else { "200 OK" }, &extra, &data[a..=b], drop);
    };
    if let Some(rest) = path_only.strip_prefix("/api/models/") {
        // /api/models/ORG/NAME/revision/REV
        let parts: Vec<&str> = rest.splitn(4, '/').collect();
        let (repo_id, rev) =
            (format!("{}/{}", parts[0], parts.get(1).unwrap_or(&"")), parts.get(3).copied().unwrap_or("main"));
        let Some(repo) = st.repos.get(&repo_id) else {
            return json_err(&mut s, "404 Not Found", "RepoNotFound", "Repository not found");
        };
        if repo.token.as_ref().is_some_and(|t| auth.as_deref() != Some(&format!("Bearer {t}"))) {
            return json_err(&mut s, "401 Unauthorized", "GatedRepo", "Access to this model is restricted");
        }
        if rev != "main" && rev != repo.commit {
            return json_err(&mut s, "404 Not Found", "RevisionNotFound", "Invalid rev id");
        }
        let siblings: Vec<Value> = repo
            .files
            .iter()
            .map(|f| {
                let mut v = json!({"rfilename": f.name, "size": f.data.len()});
                if f.lfs {
                    let sha = if st.wrong_sha { "0".repeat(64) } else { sha256(&f.data) };
                    v["lfs"] = json!({"sha256": sha, "size": f.data.len(), "pointerSize": 134});
                }
                v
            })
            .collect();
        let body = json!({"id": repo_id, "sha": repo.commit, "siblings": siblings}).to_string();
        return respond(&mut s, "200 OK", &[("Content-Type".into(), "application/json".into())], body.as_bytes(), None);
    }
    if let Some(sha) = path_only.strip_prefix("/cdn/") {
        let Some(f) = st.repos.values().flat_map(|r| &r.files).find(|f| sha256(&f.data) == sha) else {
            return respond(&mut s, "404 Not Found", &[], b"", None);
        };
        let data = f.data.clone();
        let body_request = range.as_deref() != Some("bytes=0-0");
        let drop = if body_request { st.drop_after.take() } else { None };
        drop_lock(st);
        return serve(&mut s, &data, Vec::new(), drop);
    }
    // /ORG/NAME/resolve/REV/FILE
    let parts: Vec<&str> = path_only.trim_start_matches('/').splitn(5, '/').collect();
    if parts.len() == 5 && parts[2] == "resolve" {
        let repo_id = format!("{}/{}", parts[0], parts[1]);
        let Some(repo) = st.repos.get(&repo_id) else {
            return json_err(&mut s, "404 Not Found", "RepoNotFound", "Repository not found");
        };
        if repo.token.as_ref().is_some_and(|t| auth.as_deref() != Some(&format!("Bearer {t}"))) {
            return json_err(&mut s, "401 Unauthorized", "GatedRepo", "Access to this model is restricted");
        }
        let Some(f) = repo.files.iter().find(|f| f.name == parts[4]) else {
            return json_err(&mut s, "404 Not Found", "EntryNotFound", "Entry not found");
        };
        let commit = ("X-Repo-Commit".to_string(), repo.commit.clone());
        if f.lfs {
            let sha = sha256(&f.data);
            let h = vec![
                commit,
                ("X-Linked-Etag".into(), format!("\"{sha}\"")),
                ("X-Linked-Size".into(), f.data.len().to_string()),
                ("ETag".into(), "\"pointer-etag\"".into()),
                ("Location".into(), format!("http://{addr}/cdn/{sha}")),
            ];
            return respond(&mut s, "302 Found", &h, b"", None);
        }
        let data = f.data.clone();
        let etag = format!("\"{}\"", &sha256(&data)[..40]);
        drop_lock(st);
        return serve(&mut s, &data, vec![commit, ("ETag".into(), etag)], None);
    }
    respond(&mut s, "404 Not Found", &[], b"", None);
}

fn drop_lock<T>(_g: T) {}

fn start_hub() -> Hub {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let state = Arc::new(Mutex::new(State::default()));
    let (st, a) = (state.clone(), addr.clone());
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let (st, a) = (st.clone(), a.clone());
            std::thread::spawn(move || handle(c, &a, &st));
        }
    });
    Hub { addr, state }
}

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("lily-hub-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs lily with the cache and endpoint set; (success, stdout, stderr).
fn lily(cache: &Path, endpoint: &str, env: &[(&str, &str)], args: &[&str]) -> (bool, String, String) {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lily"));
    c.args(args).env("HF_HUB_CACHE", cache).env("HF_ENDPOINT", format!("http://{endpoint}"));
    for k in ["HF_TOKEN", "HF_HUB_OFFLINE", "HF_HOME"] {
        c.env_remove(k);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    let o = c.output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stdout).into(), String::from_utf8_lossy(&o.stderr).into())
}

const RUN: [&str; 10] =
    ["run", "--raw", "--prompt-tokens", "1,2,3", "--max-tokens", "4", "--device", "cpu", "--json", "--threads=1"];

fn run_tokens(cache: &Path, endpoint: &str, env: &[(&str, &str)], model: &str) -> Value {
    let mut args = vec!["--model", model];
    args.splice(0..0, RUN.iter().copied());
    let (ok, out, err) = lily(cache, endpoint, env, &args);
    assert!(ok, "{model}: {err}");
    serde_json::from_str::<Value>(out.trim().lines().last().unwrap()).unwrap()["tokens"].clone()
}

/// The id `GET /v1/models` reports for a server started on `model` (offline).
fn served_name(cache: &Path, model: &str) -> String {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(["serve", "--model", model, "--bind", "127.0.0.1:0", "--threads", "1", "--device", "cpu"])
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    let addr = line.trim().rsplit("http://").next().unwrap().to_string();
    let mut c = TcpStream::connect(&addr).unwrap();
    c.write_all(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").unwrap();
    let mut resp = String::new();
    std::io::Read::read_to_string(&mut c, &mut resp).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let body = &resp[resp.find("\r\n\r\n").unwrap() + 4..];
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {resp}"));
    v["data"][0]["id"].as_str().unwrap().to_string()
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

#[test]
fn download_then_run_offline_from_the_cache() {
    let hub = start_hub();
    hub.state.lock().unwrap().repos.insert("org/tiny".into(), tiny_repo(COMMIT, None, None));
    let cache = tmp("dl");
    let (ok, out, err) = lily(&cache, &hub.addr, &[], &["download", "org/tiny"]);
    assert!(ok, "{err}");
    let snap = cache.join("models--org--tiny/snapshots").join(COMMIT);
    assert_eq!(PathBuf::from(out.trim()), snap);
    assert_eq!(std::fs::read_to_string(cache.join("models--org--tiny/refs/main")).unwrap().trim(), COMMIT);
    // huggingface_hub's layout: snapshot entries are relative links to blobs named by ETag.
    let data = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let link = std::fs::read_link(snap.join("model.safetensors")).unwrap();
    assert_eq!(link, PathBuf::from(format!("../../blobs/{}", sha256(&data))));
    assert_eq!(std::fs::read(snap.join("model.safetensors")).unwrap(), data);
    for skipped in ["README.md", "model-q4.gguf", "original"] {
        assert!(!snap.join(skipped).exists(), "{skipped} should not be fetched");
    }
    // Offline, with the hub gone from the request log: the same tokens as the local directory.
    let before = hub.state.lock().unwrap().log.len();
    let want = run_tokens(&cache, &hub.addr, &[], fixture().to_str().unwrap());
    let got = run_tokens(&cache, &hub.addr, &[("HF_HUB_OFFLINE", "1")], "org/tiny");
    assert_eq!(got, want);
    let got = run_tokens(&cache, &hub.addr, &[], "org/tiny@main");
    assert_eq!(got, want);
    assert_eq!(hub.state.lock().unwrap().log.len(), before, "a complete cached snapshot needs no request");
    // `lily serve` names the model after the repository, given as an id or as its snapshot path.
    for model in ["org/tiny", snap.to_str().unwrap()] {
        assert_eq!(served_name(&cache, model), "org/tiny", "{model}");
    }
    // A second download finds everything in place and fetches no file body again.
    let (ok, _, err) = lily(&cache, &hub.addr, &[], &["download", "org/tiny"]);
    assert!(ok, "{err}");
    assert!(
        hub.state.lock().unwrap().log[before..].iter().all(|l| l.starts_with("/api/")),
        "{:?}",
        hub.state.lock().unwrap().log
    );
    // Offline and not cached: a clear error, no request.
    let (ok, _, err) =
        lily(&cache, &hub.addr, &[("HF_HUB_OFFLINE", "1")], &["run", "--model", "org/other", "--prompt-tokens", "1"]);
    assert!(!ok && err.contains("HF_HUB_OFFLINE") && err.contains("not in the cache"), "{err}");
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn a_dropped_connection_resumes_on_the_next_run() {
    let hub = start_hub();
    hub.state.lock().unwrap().repos.insert("org/tiny".into(), tiny_repo(COMMIT, None, None));
    hub.state.lock().unwrap().drop_after = Some(300_000);
    let cache = tmp("drop");
    let (ok, _, err) = lily(&cache, &hub.addr, &[], &["download", "org/tiny"]);
    assert!(!ok, "the first run must fail");
    assert!(err.contains("model.safetensors") && err.contains("resume"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let data = std::fs::read(fixture().join("model.safetensors")).unwrap();
    let blob = cache.join("models--org--tiny/blobs").join(sha256(&data));
    assert!(!blob.exists(), "no half-written file under the blob's name");
    assert!(!cache.join("models--org--tiny/snapshots").join(COMMIT).join("model.safetensors").exists());
    let part = blob.with_extension("part");
    assert_eq!(std::fs::metadata(&part).unwrap().len(), 300_000);
    // The next run asks for the rest only and ends with the verified file.
    let (ok, _, err) = lily(&cache, &hub.addr, &[], &["download", "org/tiny"]);
    assert!(ok, "{err}");
    assert!(hub.state.lock().unwrap().log.iter().any(|l| l.starts_with("/cdn/") && l.ends_with("bytes=300000-")));
    assert_eq!(std::fs::read(&blob).unwrap(), data);
    run_tokens(&cache, &hub.addr, &[("HF_HUB_OFFLINE", "1")], "org/tiny");
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn a_file_that_does_not_match_its_sha256_is_removed() {
    let hub = start_hub();
    hub.state.lock().unwrap().repos.insert("org/tiny".into(), tiny_repo(COMMIT, None, None));
    hub.state.lock().unwrap().wrong_sha = true;
    let cache = tmp("sha");
    let (ok, _, err) = lily(&cache, &hub.addr, &[], &["download", "org/tiny"]);
    assert!(!ok && err.contains("model.safetensors is corrupt") && err.contains("sha256"), "{err}");
    let data = std::fs::read(fixture().join("model.safetensors")).unwrap();
    assert!(!cache.join("models--org--tiny/blobs").join(sha256(&data)).exists());
    assert!(!cache.join("models--org--tiny/snapshots").join(COMMIT).join("model.safetensors").exists());
    // Nothing half-checked is taken as complete later.
    let (ok, _, err) =
        lily(&cache, &hub.addr, &[("HF_HUB_OFFLINE", "1")], &["run", "--model", "org/tiny", "--prompt-tokens", "1"]);
    assert!(!ok && err.contains("lacks model.safetensors"), "{err}");
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn missing_gated_and_foreign_repositories_are_clear_errors() {
    let hub = start_hub();
    {
        let mut st = hub.state.lock().unwrap();
        st.repos.insert("org/tiny".into(), tiny_repo(COMMIT, None, None));
        st.repos.insert("org/gated".into(), tiny_repo(COMMIT, Some("sekrit"), None));
        st.repos.insert("org/llama".into(), tiny_repo(COMMIT, None, Some("llama")));
    }
    let cache = tmp("errs");
    let fail = |env: &[(&str, &str)], args: &[&str]| {
        let (ok, _, err) = lily(&cache, &hub.addr, env, args);
        assert!(!ok, "{args:?} should fail");
        assert!(!err.contains("panicked"), "{err}");
        err
    };
    let e = fail(&[], &["download", "org/nope"]);
    assert!(e.contains("org/nope") && e.contains("not found"), "{e}");
    let e = fail(&[], &["download", "org/tiny@v9"]);
    assert!(e.contains("revision `v9` not found"), "{e}");
    let e = fail(&[], &["run", "--model", "org/tiny", "--revision", "v9", "--prompt-tokens", "1"]);
    assert!(e.contains("revision `v9` not found"), "{e}");
    let e = fail(&[], &["download", "org/gated"]);
    assert!(e.contains("gated") && e.contains("HF_TOKEN"), "{e}");
    let e = fail(&[("HF_TOKEN", "wrong")], &["download", "org/gated"]);
    assert!(e.contains("no access"), "{e}");
    let (ok, _, err) = lily(&cache, &hub.addr, &[("HF_TOKEN", "sekrit")], &["download", "org/gated"]);
    assert!(ok, "{err}");
    let (ok, _, err) = lily(&cache, &hub.addr, &[], &["download", "org/gated", "--token", "sekrit"]);
    assert!(ok, "{err}");
    let e = fail(&[], &["download", "org/llama"]);
    assert!(e.contains("model_type `llama`") && e.contains("qwen3_5"), "{e}");
    // It stopped before the weights.
    let data = std::fs::read(fixture().join("model.safetensors")).unwrap();
    assert!(!cache.join("models--org--llama/blobs").join(sha256(&data)).exists());
    // No server at all.
    let dead = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string();
    let (ok, _, err) = lily(&cache, &dead, &[], &["download", "org/tiny"]);
    assert!(!ok && err.contains("cannot reach") && err.contains("HF_HUB_OFFLINE"), "{err}");
    std::fs::remove_dir_all(&cache).ok();
}

/// A cache laid out by huggingface_hub's rules (blobs named by hash, relative snapshot links,
/// refs/main and a tag), written here by hand, loads with no endpoint at all.
#[test]
fn a_cache_in_huggingface_hub_layout_loads() {
    let cache = tmp("layout");
    let folder = cache.join("models--mlx-community--Tiny-4bit");
    let snap = folder.join("snapshots").join(COMMIT);
    std::fs::create_dir_all(&snap).unwrap();
    std::fs::create_dir_all(folder.join("blobs")).unwrap();
    std::fs::create_dir_all(folder.join("refs")).unwrap();
    for e in std::fs::read_dir(fixture()).unwrap() {
        let e = e.unwrap();
        let data = std::fs::read(e.path()).unwrap();
        let h = sha256(&data);
        std::fs::write(folder.join("blobs").join(&h), &data).unwrap();
        std::os::unix::fs::symlink(format!("../../blobs/{h}"), snap.join(e.file_name())).unwrap();
    }
    std::fs::write(folder.join("refs/main"), COMMIT).unwrap();
    std::fs::write(folder.join("refs/v1"), COMMIT).unwrap();
    let nowhere = "127.0.0.1:9";
    let want = run_tokens(&cache, nowhere, &[], fixture().to_str().unwrap());
    assert_eq!(run_tokens(&cache, nowhere, &[], "mlx-community/Tiny-4bit"), want);
    assert_eq!(
        run_tokens(&cache, nowhere, &[("HF_HUB_OFFLINE", "1")], &format!("mlx-community/Tiny-4bit@{COMMIT}")),
        want
    );
    let mut args = vec!["--model", "mlx-community/Tiny-4bit", "--revision", "v1"];
    args.splice(0..0, RUN.iter().copied());
    assert!(lily(&cache, nowhere, &[], &args).0);
    // HF_HOME/hub is the cache when HF_HUB_CACHE is unset.
    let home = tmp("home");
    std::fs::rename(&cache, home.join("hub")).unwrap();
    let mut c = Command::new(env!("CARGO_BIN_EXE_lily"));
    let mut args: Vec<&str> = RUN.to_vec();
    args.extend(["--model", "mlx-community/Tiny-4bit"]);
    let o = c.args(&args).env_remove("HF_HUB_CACHE").env("HF_HOME", &home).env("HF_HUB_OFFLINE", "1").output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&home).ok();
}

/// A full disk: a 200 KiB tmpfs as the cache (the weights are 730 KiB). Needs the right to
/// mount, which CI's container and the developers' machine have; elsewhere it says so and
/// checks nothing.
#[test]
fn a_full_disk_is_a_clear_error() {
    let hub = start_hub();
    hub.state.lock().unwrap().repos.insert("org/tiny".into(), tiny_repo(COMMIT, None, None));
    let mnt = tmp("full");
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=200k", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: cannot mount a small tmpfs here");
        return;
    }
    let (ok, _, err) = lily(&mnt, &hub.addr, &[], &["download", "org/tiny"]);
    let _ = Command::new("umount").arg(&mnt).status();
    assert!(!ok && err.contains("no space left"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    std::fs::remove_dir_all(&mnt).ok();
}

#[test]
fn a_local_directory_named_like_an_id_wins() {
    let cwd = tmp("local");
    std::fs::create_dir_all(cwd.join("org")).unwrap();
    std::os::unix::fs::symlink(fixture(), cwd.join("org/tiny")).unwrap();
    let mut args: Vec<&str> = RUN.to_vec();
    args.extend(["--model", "org/tiny"]);
    let o = Command::new(env!("CARGO_BIN_EXE_lily"))
        .args(&args)
        .current_dir(&cwd)
        .env("HF_HUB_CACHE", cwd.join("empty-cache"))
        .env("HF_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    std::fs::remove_dir_all(&cwd).ok();
}
