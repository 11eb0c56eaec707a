//! Models by Hugging Face id (`--model mlx-community/Qwen3.6-35B-A3B-4bit`, `ORG/NAME@REVISION`):
//! found in the cache huggingface_hub and mlx-lm share, or downloaded into it.
//!
//! Cache (huggingface_hub's rules): `HF_HUB_CACHE`, else `HF_HOME/hub`, else
//! `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`. A repository lives in
//! `models--ORG--NAME/`: `refs/REVISION` holds a commit hash, `snapshots/COMMIT/FILE` links to
//! `blobs/ETAG`. A local directory named like an id still wins when it exists.
//!
//! Downloads go through the `hf-hub` crate (its resumable `.part` files, blob/snapshot layout and
//! refs); lily adds the file selection (only what it reads), a check that the repository is a
//! qwen3_5 / qwen3_5_moe checkpoint before the weights come, the size and sha256 checks of what
//! arrived, progress, and errors that say what to do. `HF_ENDPOINT`, `HF_TOKEN` (or `--token`,
//! or the token file huggingface-cli writes) and `HF_HUB_OFFLINE=1` are honoured.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::io::{IsTerminal, Read};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// A repository id and revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubId {
    pub repo: String,
    pub revision: String,
}

fn id_part_ok(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 96
        && !s.starts_with(['.', '-'])
        && !s.contains("..")
        && s.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
}

impl HubId {
    /// `ORG/NAME` or `ORG/NAME@REVISION` (`revision` from `--revision`; if both name one they must
    /// agree). None when `spec` does not look like a hub id.
    pub fn parse(spec: &str, revision: Option<&str>) -> Option<Result<HubId>> {
        let (repo, at) = match spec.split_once('@') {
            Some((r, v)) => (r, Some(v)),
            None => (spec, None),
        };
        let (org, name) = repo.split_once('/')?;
        if !id_part_ok(org) || !id_part_ok(name) {
            return None;
        }
        let rev = match (at, revision) {
            (Some(a), Some(b)) if a != b => {
                return Some(Err(anyhow!("--model {spec} names revision `{a}` but --revision says `{b}`")))
            }
            (Some(a), _) | (None, Some(a)) => a,
            (None, None) => "main",
        };
        if rev.is_empty() || rev.contains("..") || rev.starts_with('/') || rev.contains(char::is_whitespace) {
            return Some(Err(anyhow!("--model {spec}: `{rev}` is not a revision")));
        }
        Some(Ok(HubId { repo: repo.to_string(), revision: rev.to_string() }))
    }

    fn folder(&self, cache: &Path) -> PathBuf {
        cache.join(format!("models--{}", self.repo.replace('/', "--")))
    }
}

impl std::fmt::Display for HubId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.revision == "main" {
            write!(f, "{}", self.repo)
        } else {
            write!(f, "{}@{}", self.repo, self.revision)
        }
    }
}

/// The hub cache directory.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(c) = var("HF_HUB_CACHE") {
        return c;
    }
    if let Some(h) = var("HF_HOME") {
        return h.join("hub");
    }
    let base =
        var("XDG_CACHE_HOME").or_else(|| var("HOME").map(|h| h.join(".cache"))).unwrap_or_else(|| ".cache".into());
    base.join("huggingface").join("hub")
}

/// How to reach the hub.
#[derive(Clone, Debug)]
pub struct HubOptions {
    pub cache: PathBuf,
    pub endpoint: String,
    pub token: Option<String>,
    /// `HF_HUB_OFFLINE=1`: the cache alone.
    pub offline: bool,
}

impl HubOptions {
    /// From the environment; `token` (`--token`) beats `HF_TOKEN`, which beats the token file.
    pub fn from_env(token: Option<String>) -> HubOptions {
        let cache = cache_dir();
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let token = token.or_else(|| env("HF_TOKEN")).or_else(|| {
            let f = cache.parent().map(|p| p.join("token"))?;
            std::fs::read_to_string(f).ok().map(|t| t.trim().to_string()).filter(|t| !t.is_empty())
        });
        let offline = env("HF_HUB_OFFLINE")
            .is_some_and(|v| matches!(v.to_ascii_lowercase().as_str(), "1" | "true" | "yes" | "on"));
        HubOptions {
            cache,
            endpoint: env("HF_ENDPOINT")
                .unwrap_or_else(|| "https://huggingface.co".into())
                .trim_end_matches('/')
                .to_string(),
            token,
            offline,
        }
    }
}

/// Whether lily reads this repository file (everything else, such as other formats, the vision
/// processor or files in subfolders, is left on the hub).
pub fn wanted(name: &str) -> bool {
    !name.contains('/')
        && (matches!(
            name,
            "config.json"
                | "generation_config.json"
                | "tokenizer.json"
                | "tokenizer_config.json"
                | "special_tokens_map.json"
                | "chat_template.jinja"
                | "chat_template.json"
                | "model.safetensors.index.json"
        ) || name.ends_with(".safetensors"))
}

/// What a snapshot still lacks to be loaded: config.json and every weight file.
fn missing(dir: &Path) -> Vec<String> {
    let mut need = vec!["config.json".to_string()];
    let index = dir.join("model.safetensors.index.json");
    match std::fs::read_to_string(&index).ok().and_then(|t| serde_json::from_str::<Value>(&t).ok()) {
        Some(v) => {
            let mut shards: Vec<String> = v["weight_map"]
                .as_object()
                .into_iter()
                .flatten()
                .filter_map(|(_, f)| f.as_str().map(str::to_string))
                .collect();
            shards.sort();
            shards.dedup();
            need.extend(shards);
        }
        None => need.push("model.safetensors".into()),
    }
    need.into_iter().filter(|f| !dir.join(f).is_file()).collect()
}

/// The cached snapshot the id's revision names, if there is one.
pub fn cached_snapshot(cache: &Path, id: &HubId) -> Option<PathBuf> {
    let folder = id.folder(cache);
    let is_commit = id.revision.len() == 40 && id.revision.chars().all(|c| c.is_ascii_hexdigit());
    let commit = if is_commit {
        id.revision.clone()
    } else {
        std::fs::read_to_string(folder.join("refs").join(&id.revision)).ok()?.trim().to_string()
    };
    let snap = folder.join("snapshots").join(commit);
    snap.is_dir().then_some(snap)
}

/// Resolves `--model`: an existing local path or `synthetic:` stays as it is (None); a hub id
/// becomes its snapshot directory, from the cache or downloaded.
pub fn resolve(spec: &str, revision: Option<&str>, opts: &HubOptions) -> Result<Option<PathBuf>> {
    if spec.starts_with("synthetic:") || Path::new(spec).exists() {
        if revision.is_some() {
            bail!("--revision only applies to Hugging Face ids (ORG/NAME), not to {spec}");
        }
        return Ok(None);
    }
    let Some(id) = HubId::parse(spec, revision) else {
        if revision.is_some() {
            bail!("--revision only applies to Hugging Face ids (ORG/NAME)");
        }
        return Ok(None);
    };
    let id = id?;
    if let Some(snap) = cached_snapshot(&opts.cache, &id) {
        if missing(&snap).is_empty() {
            return Ok(Some(snap));
        }
    }
    if opts.offline {
        let why = match cached_snapshot(&opts.cache, &id) {
            Some(s) => format!("its snapshot {} lacks {}", s.display(), missing(&s).join(", ")),
            None => format!("it is not in the cache ({})", opts.cache.display()),
        };
        bail!("HF_HUB_OFFLINE is set and {id} cannot be used: {why}. Unset HF_HUB_OFFLINE to download it.");
    }
    download(&id, opts)
        .with_context(|| format!("`{spec}` is not a local directory, so it was taken as a Hugging Face id"))
        .map(Some)
}

/// One repository file as the revision-info endpoint lists it.
#[derive(Clone, Debug)]
struct RemoteFile {
    name: String,
    size: Option<u64>,
    /// sha256 of the content, for LFS files.
    sha256: Option<String>,
}

/// An HTTP error from the hub as a sentence that says what to do.
fn hub_error(e: ureq::Error, id: &HubId, opts: &HubOptions, what: &str) -> anyhow::Error {
    match e {
        ureq::Error::Status(code, r) => {
            let msg = r.header("x-error-message").map(|m| format!(" ({m})")).unwrap_or_default();
            match code {
                401 | 403 if opts.token.is_none() => anyhow!(
                    "{id}: {what}: the hub answered {code}{msg}: the repository is gated or private; accept its terms on the hub, then pass --token or set HF_TOKEN"
                ),
                401 | 403 => anyhow!("{id}: {what}: the hub answered {code}{msg}: the token has no access to this repository"),
                404 => match r.header("x-error-code") {
                    Some("RevisionNotFound") => anyhow!("{id}: revision `{}` not found{msg}", id.revision),
                    _ => anyhow!(
                        "{id}: repository or revision not found on {}{msg} (a private repository also answers 404 without a token)",
                        opts.endpoint
                    ),
                },
                _ => anyhow!("{id}: {what}: the hub answered HTTP {code}{msg}"),
            }
        }
        ureq::Error::Transport(t) => anyhow!(
            "{id}: {what}: cannot reach {}: {t} (no network? HF_HUB_OFFLINE=1 uses the cache alone)",
            opts.endpoint
        ),
    }
}

/// An error of the download library, with the io causes named.
fn download_error(e: hf_hub::api::sync::ApiError, id: &HubId, opts: &HubOptions, file: &str) -> anyhow::Error {
    use hf_hub::api::sync::ApiError as E;
    match e {
        E::RequestError(r) => hub_error(*r, id, opts, &format!("downloading {file}")),
        E::IoError(io) if io.raw_os_error() == Some(28) => {
            anyhow!("{id}: downloading {file}: no space left on the disk holding {}", opts.cache.display())
        }
        E::IoError(io) => anyhow!(
            "{id}: downloading {file} was interrupted: {io}; the partial file is kept in {} and the next run resumes it",
            opts.cache.display()
        ),
        other => anyhow!("{id}: downloading {file}: {other}"),
    }
}

fn api(opts: &HubOptions) -> Result<hf_hub::api::sync::Api> {
    hf_hub::api::sync::ApiBuilder::from_cache(hf_hub::Cache::new(opts.cache.clone()))
        .with_endpoint(opts.endpoint.clone())
        .with_token(opts.token.clone())
        .with_progress(false)
        .with_user_agent("lily", env!("CARGO_PKG_VERSION"))
        .build()
        .map_err(|e| anyhow!("setting up the hub client: {e}"))
}

/// The revision's commit and files (`/api/models/ORG/NAME/revision/REV?blobs=true`).
fn revision_info(
    repo: &hf_hub::api::sync::ApiRepo,
    id: &HubId,
    opts: &HubOptions,
) -> Result<(String, Vec<RemoteFile>)> {
    let r = repo.info_request().query("blobs", "true").call().map_err(|e| hub_error(e, id, opts, "revision info"))?;
    let v: Value = r.into_json().map_err(|e| anyhow!("{id}: the hub's revision info is not JSON: {e}"))?;
    let sha = v["sha"].as_str().with_context(|| format!("{id}: the hub's revision info has no commit `sha`"))?;
    let files = v["siblings"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| {
            Some(RemoteFile {
                name: s["rfilename"].as_str()?.to_string(),
                size: s["lfs"]["size"].as_u64().or_else(|| s["size"].as_u64()),
                sha256: s["lfs"]["sha256"].as_str().map(str::to_string),
            })
        })
        .collect();
    Ok((sha.to_string(), files))
}

/// The repository's `model_type` must be one lily runs (before gigabytes of weights come).
fn check_model_type(config: &Path, id: &HubId) -> Result<()> {
    let v: Value = serde_json::from_str(&std::fs::read_to_string(config)?)
        .with_context(|| format!("{id}: config.json is not valid JSON"))?;
    let t = v["model_type"].as_str().unwrap_or("");
    let inner = v["text_config"]["model_type"].as_str().unwrap_or("");
    let ok = |t: &str| t.starts_with("qwen3_5");
    if !(ok(t) || ok(inner)) {
        let what = if t.is_empty() { "no model_type".to_string() } else { format!("model_type `{t}`") };
        bail!("{id} is not a Qwen3.5/3.6 checkpoint: its config.json says {what}; lily runs qwen3_5_moe and qwen3_5");
    }
    Ok(())
}

/// Checks a downloaded file against the size and sha256 the hub listed. A short file is moved
/// back to the blob's `.part` (the next run resumes it); any other mismatch is deleted.
fn verify(path: &Path, f: &RemoteFile, id: &HubId) -> Result<()> {
    let blob = std::fs::canonicalize(path)?;
    let len = std::fs::metadata(&blob)?.len();
    let discard = |resume: bool| {
        if resume {
            let _ = std::fs::rename(&blob, blob.with_extension("part"));
        } else {
            let _ = std::fs::remove_file(&blob);
        }
        let _ = std::fs::remove_file(path);
    };
    if let Some(want) = f.size {
        if len < want {
            discard(true);
            bail!(
                "{id}: {} arrived short ({len} of {want} bytes: the connection dropped); run again to resume",
                f.name
            );
        }
        if len > want {
            discard(false);
            bail!("{id}: {} arrived with {len} bytes where the hub lists {want}; removed, run again", f.name);
        }
    }
    if let Some(want) = &f.sha256 {
        let got = sha256_file(&blob)?;
        if !got.eq_ignore_ascii_case(want) {
            discard(false);
            bail!("{id}: {} is corrupt (sha256 {got}, the hub lists {want}); removed, run again", f.name);
        }
    }
    Ok(())
}

pub fn sha256_file(path: &Path) -> Result<String> {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    let mut file = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Downloads what lily needs of a revision into the cache and returns its snapshot directory.
pub fn download(id: &HubId, opts: &HubOptions) -> Result<PathBuf> {
    let api = api(opts)?;
    let repo = api.repo(hf_hub::Repo::with_revision(id.repo.clone(), hf_hub::RepoType::Model, id.revision.clone()));
    let (commit, files) = revision_info(&repo, id, opts)?;
    let mut files: Vec<RemoteFile> = files.into_iter().filter(|f| wanted(&f.name)).collect();
    if !files.iter().any(|f| f.name == "config.json") {
        bail!("{id} has no config.json: it is not a model checkpoint lily can run");
    }
    if !files.iter().any(|f| f.name.ends_with(".safetensors")) {
        bail!("{id} has no .safetensors weights (lily reads the MLX and Hugging Face safetensors layouts; GGUF is not supported)");
    }
    // config.json first, so a repository of another model fails before its weights come.
    files.sort_by_key(|f| (f.name != "config.json", f.name.ends_with(".safetensors"), f.name.clone()));
    let snapshot = id.folder(&opts.cache).join("snapshots").join(&commit);
    let total: u64 = files.iter().filter_map(|f| f.size).sum();
    eprintln!("lily: {id} (commit {}): {} files, {}", &commit[..commit.len().min(12)], files.len(), human(total));
    for f in &files {
        let local = snapshot.join(&f.name);
        let have = std::fs::metadata(&local).ok().map(|m| m.len());
        if have.is_some() && have == f.size.or(have) {
            if f.name == "config.json" {
                check_model_type(&local, id)?;
            }
            continue;
        }
        let bar = Bar::new(&f.name);
        let path = repo.download_with_progress(&f.name, bar).map_err(|e| download_error(e, id, opts, &f.name))?;
        verify(&path, f, id)?;
        if f.name == "config.json" {
            check_model_type(&path, id)?;
        }
    }
    // The ref names the commit even when every file was cached already.
    let refs = id.folder(&opts.cache).join("refs");
    let is_commit = id.revision.len() == 40 && id.revision.chars().all(|c| c.is_ascii_hexdigit());
    if !is_commit {
        let r = refs.join(&id.revision);
        std::fs::create_dir_all(r.parent().unwrap_or(&refs))?;
        std::fs::write(&r, &commit)?;
    }
    let lacking = missing(&snapshot);
    if !lacking.is_empty() {
        bail!("{id}: the snapshot still lacks {} after the download", lacking.join(", "));
    }
    Ok(snapshot)
}

fn human(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b => format!("{:.1} KiB", b as f64 / 1024.0),
    }
}

/// Download progress: a bar with bytes, rate and time left on a terminal, else a log line
/// every 10 s and at the end.
struct Bar {
    name: String,
    bar: Option<indicatif::ProgressBar>,
    total: usize,
    done: usize,
    start: Instant,
    last_log: Instant,
}

impl Bar {
    fn new(name: &str) -> Bar {
        let now = Instant::now();
        Bar { name: name.to_string(), bar: None, total: 0, done: 0, start: now, last_log: now }
    }

    fn log(&self) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let rate = self.done as f64 / secs;
        let left = if rate > 0.0 { (self.total.saturating_sub(self.done)) as f64 / rate } else { 0.0 };
        eprintln!(
            "lily: {}: {} of {} ({:.0}%), {}/s, {:.0} s left",
            self.name,
            human(self.done as u64),
            human(self.total as u64),
            100.0 * self.done as f64 / self.total.max(1) as f64,
            human(rate as u64),
            left
        );
    }
}

impl hf_hub::api::Progress for Bar {
    fn init(&mut self, size: usize, _filename: &str) {
        self.total = size;
        self.done = 0;
        if std::io::stderr().is_terminal() {
            let b = indicatif::ProgressBar::new(size as u64);
            b.set_style(
                indicatif::ProgressStyle::with_template(
                    "{msg} [{bar:30}] {bytes}/{total_bytes} {binary_bytes_per_sec} {eta} left",
                )
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
                .progress_chars("=> "),
            );
            b.set_message(self.name.clone());
            self.bar = Some(b);
        }
    }

    fn update(&mut self, size: usize) {
        self.done += size;
        match &self.bar {
            Some(b) => b.set_position(self.done as u64),
            None if self.last_log.elapsed().as_secs() >= 10 => {
                self.last_log = Instant::now();
                self.log();
            }
            None => {}
        }
    }

    fn finish(&mut self) {
        match self.bar.take() {
            Some(b) => b.finish_and_clear(),
            None => self.log(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_revisions() {
        let p = |s: &str, r: Option<&str>| HubId::parse(s, r).map(|x| x.map_err(|e| e.to_string()));
        assert_eq!(
            p("mlx-community/Qwen3.6-35B-A3B-4bit", None),
            Some(Ok(HubId { repo: "mlx-community/Qwen3.6-35B-A3B-4bit".into(), revision: "main".into() }))
        );
        assert_eq!(p("a/b@v1.0", None).unwrap().unwrap().revision, "v1.0");
        assert_eq!(p("a/b", Some("refs/pr/3")).unwrap().unwrap().revision, "refs/pr/3");
        assert!(p("a/b@x", Some("y")).unwrap().is_err());
        for not_an_id in ["model", "./a/b", "/abs/path", "a/b/c", "../a/b", "a/..", "synthetic:tiny", "a b/c"] {
            assert!(p(not_an_id, None).is_none(), "{not_an_id}");
        }
        assert!(wanted("model-00001-of-00004.safetensors") && wanted("config.json") && wanted("chat_template.jinja"));
        assert!(!wanted("model.gguf") && !wanted("original/model.safetensors") && !wanted("README.md"));
    }
}
