//! `lily download ORG/NAME`: fetches a checkpoint into the Hugging Face cache without running it.

use anyhow::{bail, Result};
use clap::Args;

#[derive(Args, Debug)]
pub struct DownloadArgs {
    /// Hugging Face id, `ORG/NAME` or `ORG/NAME@REVISION`.
    pub model: String,
    /// Revision (branch, tag or commit).
    #[arg(long)]
    pub revision: Option<String>,
    /// Hugging Face token for gated or private repositories (default: HF_TOKEN).
    #[arg(long)]
    pub token: Option<String>,
}

pub fn run(a: DownloadArgs) -> Result<()> {
    let Some(id) = lily::hub::HubId::parse(&a.model, a.revision.as_deref()) else {
        bail!("`{}` is not a Hugging Face id (ORG/NAME[@REVISION])", a.model);
    };
    let id = id?;
    let opts = lily::hub::HubOptions::from_env(a.token);
    if opts.offline {
        bail!("HF_HUB_OFFLINE is set: nothing can be downloaded");
    }
    let dir = lily::hub::download(&id, &opts)?;
    println!("{}", dir.display());
    Ok(())
}
