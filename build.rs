// Records the git commit for `lily bench` headers, with "+dirty" when the working tree has
// uncommitted changes at build time (so a measured binary names what it was built from).
fn main() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let mut commit = git(&["rev-parse", "--short=10", "HEAD"]).unwrap_or_else(|| "unknown".into());
    if git(&["status", "--porcelain", "--untracked-files=no"]).is_some_and(|s| !s.is_empty()) {
        commit.push_str("+dirty");
    }
    println!("cargo:rustc-env=LILY_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-changed=.git/HEAD");
    println!("cargo:rerun-if-changed=.git/refs/heads");
    println!("cargo:rerun-if-changed=.git/index");
    for d in ["src", "tests", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={d}");
    }
}
