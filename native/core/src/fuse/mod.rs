//! The FUSE server of the native engine (DESIGN.md's `fuse/`): fuser speaks the kernel protocol without
//! libfuse, and several OS threads read one connection (each its own descriptor, FUSE_DEV_IOC_CLONE), so
//! every request of a mount is answered without Python and on as many cores as there are readers.
//!
//! Read-only for now: names from `vfs::namespace`, bytes from `vfs::reader`. Open files and directory
//! snapshots are numbered handles in plain maps, the state a successor process would need to go on
//! serving (DESIGN.md: the connection can be handed over).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    BackgroundSession, Config, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, KernelConfig, LockOwner, MountOption, OpenFlags, ReplyAttr, ReplyData,
    ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyXattr, Request,
    SessionACL,
};

use crate::cache::disk::DiskStats;
use crate::sync::lock;
use crate::vfs::namespace::{Kind, Node, ROOT};
use crate::vfs::reader::{Blocks, OpenFile};

/// How the mount shows its files.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// How long the kernel trusts names and attributes.
    pub attr_ttl: Duration,
    pub uid: u32,
    pub gid: u32,
    pub file_mode: u16,
    pub dir_mode: u16,
    /// Requests served at once: the threads reading the connection.
    pub threads: usize,
    pub allow_other: bool,
    /// The source as `mount` lists it.
    pub fsname: String,
    /// The source's URL (credentials left out) and where it is mounted, for `pffs stats`.
    pub source: String,
    pub mountpoint: String,
    /// The URL of the mount's root ("s3://bucket/prefix/"): a file's is this and its name.
    pub root_url: String,
}

/// A directory's entries as opendir saw them: (inode, type, name), "." and ".." first.
type DirSnapshot = Arc<Vec<(u64, FileType, String)>>;

pub struct PffsFs {
    blocks: Arc<Blocks>,
    config: ServeConfig,
    files: Mutex<HashMap<u64, Arc<OpenFile>>>,
    dirs: Mutex<HashMap<u64, DirSnapshot>>,
    next_handle: AtomicU64,
    /// The ETag of each file's last open: the kernel keeps its cached pages only for the same version.
    opened_versions: Mutex<HashMap<u64, Arc<str>>>,
}

impl PffsFs {
    pub fn new(blocks: Arc<Blocks>, config: ServeConfig) -> Self {
        PffsFs {
            blocks,
            config,
            files: Mutex::new(HashMap::new()),
            dirs: Mutex::new(HashMap::new()),
            next_handle: AtomicU64::new(1),
            opened_versions: Mutex::new(HashMap::new()),
        }
    }

    fn attr(&self, node: &Node) -> FileAttr {
        let mtime = UNIX_EPOCH + Duration::from_secs(node.mtime_secs.max(0) as u64);
        let (kind, perm, size, nlink) = match node.kind {
            Kind::File => (FileType::RegularFile, self.config.file_mode, node.size, 1),
            Kind::Dir => (FileType::Directory, self.config.dir_mode, 0, 2),
        };
        FileAttr {
            ino: INodeNo(node.ino),
            size,
            blocks: size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm,
            nlink,
            uid: self.config.uid,
            gid: self.config.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    fn handle(&self) -> u64 {
        self.next_handle.fetch_add(1, Ordering::Relaxed)
    }
}

fn errno(code: i32) -> Errno {
    Errno::from_i32(code)
}

impl Filesystem for PffsFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> io::Result<()> {
        // Many reads in flight at once: the kernel's default of 12 background requests would queue
        // a DataLoader's workers behind each other.
        let _ = config.set_max_background(64);
        let _ = config.set_congestion_threshold(48);
        let _ = config.set_max_readahead(4 << 20);
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str() else {
            return reply.error(Errno::ENOENT); // keys are UTF-8
        };
        match self.blocks.namespace.lookup(parent.0, name) {
            Ok(node) => reply.entry(&self.config.attr_ttl, &self.attr(&node), Generation(0)),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, fh: Option<FileHandle>, reply: ReplyAttr) {
        // An open file answers with its pinned version: its size does not change under its reader.
        if let Some(file) = fh.and_then(|fh| lock(&self.files).get(&fh.0).cloned()) {
            return reply.attr(&self.config.attr_ttl, &self.attr(&file.node));
        }
        match self.blocks.namespace.getattr(ino.0) {
            Ok(node) => reply.attr(&self.config.attr_ttl, &self.attr(&node)),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.0 & libc::O_ACCMODE != libc::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let node = match self.blocks.namespace.getattr(ino.0) {
            Ok(node) if node.kind == Kind::File => node,
            Ok(_) => return reply.error(Errno::EISDIR),
            Err(code) => return reply.error(errno(code)),
        };
        let same_version = {
            let mut versions = lock(&self.opened_versions);
            let previous = versions.insert(node.ino, node.etag.clone());
            previous.as_ref() == Some(&node.etag)
        };
        let fh = self.handle();
        lock(&self.files).insert(fh, Arc::new(OpenFile::new(node)));
        self.blocks.stats.open_files.fetch_add(1, Ordering::Relaxed);
        let keep = if same_version {
            FopenFlags::FOPEN_KEEP_CACHE
        } else {
            FopenFlags::empty() // another version: the kernel drops the pages it holds of the file
        };
        reply.opened(FileHandle(fh), keep);
    }

    fn read(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(file) = lock(&self.files).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        match self.blocks.read(&file, offset, size as usize) {
            Ok(out) => reply.data(out.bytes()),
            Err(code) => reply.error(errno(code)),
        }
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if lock(&self.files).remove(&fh.0).is_some() {
            self.blocks.stats.open_files.fetch_sub(1, Ordering::Relaxed);
        }
        reply.ok();
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        let entries = match self.blocks.namespace.entries(ino.0) {
            Ok(entries) => entries,
            Err(code) => return reply.error(errno(code)),
        };
        let parent = self
            .blocks
            .namespace
            .node(ino.0)
            .map_or(ino.0, |node| node.parent);
        let mut listing = vec![
            (ino.0, FileType::Directory, ".".to_string()),
            (parent, FileType::Directory, "..".to_string()),
        ];
        listing.extend(entries.into_iter().map(|(name, node)| {
            let kind = match node.kind {
                Kind::File => FileType::RegularFile,
                Kind::Dir => FileType::Directory,
            };
            (node.ino, kind, name)
        }));
        let fh = self.handle();
        lock(&self.dirs).insert(fh, Arc::new(listing));
        reply.opened(FileHandle(fh), FopenFlags::empty());
    }

    fn readdir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let Some(listing) = lock(&self.dirs).get(&fh.0).cloned() else {
            return reply.error(Errno::EBADF);
        };
        for (i, (ino, kind, name)) in listing.iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(*ino), (i + 1) as u64, *kind, name) {
                break;
            }
        }
        reply.ok();
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        lock(&self.dirs).remove(&fh.0);
        reply.ok();
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // An object store has no size: say "large and empty", as Mountpoint and s3fs do, so tools that
        // check free space before reading go on.
        let blocks = 1u64 << 40;
        reply.statfs(blocks, blocks, blocks, 1 << 30, 1 << 30, 4096, 255, 4096);
    }

    fn getxattr(&self, _req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        let Some(field) = name.to_str().and_then(|n| n.strip_prefix(XATTR_PREFIX)) else {
            return reply.error(Errno::NO_XATTR);
        };
        let value = match self.xattr(ino.0, field) {
            Ok(Some(value)) => value,
            Ok(None) => return reply.error(Errno::NO_XATTR),
            Err(code) => return reply.error(errno(code)),
        };
        answer_xattr(reply, size, value.as_bytes());
    }

    fn listxattr(&self, _req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        let Some(node) = self.blocks.namespace.node(ino.0) else {
            return reply.error(Errno::ENOENT);
        };
        let mut names = vec!["url"];
        if node.kind == Kind::File {
            names.extend(["etag", "cached"]);
        }
        if node.ino == ROOT {
            names.extend(["stats", "pid"]);
        }
        let mut list = Vec::new();
        for name in names {
            list.extend_from_slice(XATTR_PREFIX.as_bytes());
            list.extend_from_slice(name.as_bytes());
            list.push(0);
        }
        answer_xattr(reply, size, &list);
    }

    fn access(&self, _req: &Request, _ino: INodeNo, mask: fuser::AccessFlags, reply: ReplyEmpty) {
        if mask.bits() & libc::W_OK != 0 {
            return reply.error(Errno::EROFS);
        }
        reply.ok();
    }
}

/// What `pffs stats` and the tools read of a mount (as the Python engine's pffs.fuse.operations does).
const XATTR_PREFIX: &str = "user.pffs.";

impl PffsFs {
    fn xattr(&self, ino: u64, field: &str) -> Result<Option<String>, i32> {
        let node = self.blocks.namespace.node(ino).ok_or(libc::ENOENT)?;
        let is_file = node.kind == Kind::File;
        Ok(match field {
            "stats" if ino == ROOT => Some(report_json(&self.blocks, &self.config)),
            "pid" if ino == ROOT => Some(std::process::id().to_string()),
            "url" => {
                let prefix = self.blocks.namespace.node(ROOT).map(|root| root.key);
                let relative = prefix
                    .as_deref()
                    .and_then(|p| node.key.strip_prefix(p))
                    .unwrap_or(&node.key);
                Some(format!("{}{relative}", self.config.root_url))
            }
            "etag" if is_file => Some(node.etag.trim_matches('"').to_string()),
            "cached" if is_file => Some(format!("{}", self.blocks.cached_fraction(&node))),
            _ => None,
        })
    }
}

/// The value, or its size when asked for the size (size 0), or ERANGE when it does not fit.
fn answer_xattr(reply: ReplyXattr, size: u32, value: &[u8]) {
    if size == 0 {
        reply.size(value.len() as u32);
    } else if value.len() > size as usize {
        reply.error(Errno::ERANGE);
    } else {
        reply.data(value);
    }
}

/// The mount's report, in the shape of the Python engine's (`pffs stats`, the Prometheus exporter):
/// what the native engine does not have yet (a disk tier, uploads, latencies) is absent or zero.
pub fn report_json(blocks: &Blocks, config: &ServeConfig) -> String {
    let reader = &blocks.stats;
    let names = &blocks.namespace.stats;
    let memory = blocks.tier.stats();
    let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
    let disk = blocks.disk.as_ref().map(|disk| &disk.stats);
    let disk_load = |pick: fn(&DiskStats) -> &AtomicU64| disk.map_or(0, |d| load(pick(d)));
    let usage = blocks.disk_usage();
    let cache = json_object(&[
        ("memory_hits", memory.hits),
        ("disk_hits", load(&reader.disk_hits)),
        ("misses", load(&reader.misses)),
        (
            "prefetches",
            load(&reader.prefetches) + load(&reader.disk_ahead),
        ),
        ("prefetch_hits", memory.prefetch_hits),
        ("bytes_from_memory", load(&reader.bytes_from_memory)),
        ("bytes_from_disk", load(&reader.bytes_from_disk)),
        ("bytes_fetched", load(&reader.fetched_bytes)),
        ("memory_evictions", memory.evictions),
        ("disk_evictions", usage.evictions),
        ("corrupt_blocks", disk_load(|d| &d.corrupt)),
        (
            "disk_write_failures",
            disk_load(|d| &d.dropped) + disk_load(|d| &d.write_errors),
        ),
        ("disk_writes_queued", disk_load(|d| &d.queued)),
        ("stale_metadata_served", load(&names.stale_served)),
    ]);
    let cache_usage = json_object(&[
        ("memory_bytes", memory.bytes),
        ("memory_capacity_bytes", blocks.tier.capacity() as u64),
        ("disk_bytes", usage.bytes),
        ("disk_capacity_bytes", usage.capacity),
        ("disk_bound_bytes", usage.bound),
    ]);
    let get = json_object(&[
        ("requests", load(&reader.fetches)),
        ("errors", load(&reader.fetch_errors)),
    ]);
    let list = json_object(&[
        ("requests", load(&names.lists)),
        ("errors", load(&names.backend_errors)),
    ]);
    let totals = json_fields(&[
        ("reads", load(&reader.reads)),
        ("bytes_read", load(&reader.bytes_read)),
        ("shared_waits", memory.shared_waits),
        ("uploads_pending", 0),
        ("uploads_done", 0),
        ("upload_failures", 0),
        ("open_files", load(&reader.open_files)),
        ("pid", u64::from(std::process::id())),
        ("threads", config.threads as u64),
    ]);
    format!(
        "{{\"engine\": \"native\", \"source\": {}, \"mountpoint\": {}, \"cache\": {cache}, \
         \"cache_usage\": {cache_usage}, \"backend_requests\": {{\"get\": {get}, \"list\": {list}}}, {}}}",
        json_string(&config.source),
        json_string(&config.mountpoint),
        totals,
    )
}

/// `{"name": value, ...}`.
fn json_object(fields: &[(&str, u64)]) -> String {
    format!("{{{}}}", json_fields(fields))
}

/// `"name": value, ...`: an object's fields.
fn json_fields(fields: &[(&str, u64)]) -> String {
    let fields: Vec<String> = fields
        .iter()
        .map(|(name, value)| format!("\"{name}\": {value}"))
        .collect();
    fields.join(", ")
}

/// `text` as a JSON string, quotes included.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A mount being served by background threads; unmounted when dropped.
pub struct Mounted {
    session: Option<BackgroundSession>,
}

impl Mounted {
    /// Whether serving ended: unmounted (from here or outside) or the connection aborted.
    pub fn ended(&self) -> bool {
        self.session
            .as_ref()
            .is_none_or(|session| session.guard.is_finished())
    }

    /// Unmounts (if still mounted) and waits for the serving threads to end.
    pub fn unmount(&mut self) -> io::Result<()> {
        match self.session.take() {
            Some(session) if session.guard.is_finished() => session.join(),
            Some(session) => session.umount_and_join(),
            None => Ok(()),
        }
    }
}

/// Mounts `fs` at `mountpoint`, read-only, and serves it on `threads` threads in the background.
pub fn mount(fs: PffsFs, mountpoint: &Path) -> io::Result<Mounted> {
    let served = &fs.config;
    let mut options = vec![
        MountOption::RO,
        MountOption::NoAtime,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::FSName(served.fsname.clone()),
        MountOption::Subtype("pffs".into()),
    ];
    if served.allow_other {
        options.push(MountOption::CUSTOM("allow_other".into()));
    }
    let mut config = Config::default();
    config.mount_options = options;
    config.acl = if served.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    config.n_threads = Some(served.threads.max(1));
    config.clone_fd = true;
    let session = fuser::Session::new(fs, mountpoint, &config)?;
    Ok(Mounted {
        session: Some(session.spawn()?),
    })
}
