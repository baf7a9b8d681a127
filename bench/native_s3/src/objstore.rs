//! The Arrow project's `object_store` (its `aws` feature: reqwest, hyper, rustls) on a multi-thread tokio
//! runtime with as many workers as the request's threads, and as many concurrent tasks: each task takes the
//! next job, asks for its range with `get_opts`, and copies the body's chunks into the job's buffer as they
//! come (what a cache receiving into its own blocks would do).

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};

use crate::{Job, Run, Spec};

pub fn prepare(spec: &Spec, jobs: Vec<Job>) -> Result<Run, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(spec.threads)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let store = AmazonS3Builder::new()
        .with_endpoint(&spec.endpoint)
        .with_allow_http(true)
        .with_bucket_name(&spec.bucket)
        .with_region(&spec.region)
        .with_access_key_id(&spec.access_key)
        .with_secret_access_key(&spec.secret_key)
        .build()
        .map_err(|e| e.to_string())?;
    let store: Arc<dyn ObjectStore> = Arc::new(store);
    let tasks = spec.threads;
    Ok(Box::new(move || {
        let done = runtime.block_on(run(store, tasks, jobs));
        runtime.shutdown_background();
        done
    }))
}

async fn run(
    store: Arc<dyn ObjectStore>,
    tasks: usize,
    mut jobs: Vec<Job>,
) -> Result<Vec<Job>, String> {
    jobs.reverse(); // popped from the end: taken in order
    let queue = Arc::new(Mutex::new(jobs));
    let done = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..tasks)
        .map(|_| {
            let (store, queue, done) = (store.clone(), queue.clone(), done.clone());
            tokio::spawn(async move {
                loop {
                    let next = queue.lock().unwrap().pop();
                    let Some(mut job) = next else {
                        return Ok::<(), String>(());
                    };
                    get(store.as_ref(), &mut job)
                        .await
                        .map_err(|e| format!("{}: {e}", job.key))?;
                    done.lock().unwrap().push(job);
                }
            })
        })
        .collect();
    for handle in handles {
        handle.await.map_err(|e| e.to_string())??;
    }
    let done = std::mem::take(&mut *done.lock().unwrap());
    Ok(done)
}

async fn get(store: &dyn ObjectStore, job: &mut Job) -> Result<(), String> {
    let end = job.start + job.buffer.len() as u64;
    let options = GetOptions {
        range: Some(GetRange::Bounded(job.start..end)),
        ..Default::default()
    };
    let answer = store
        .get_opts(&Path::from(job.key.as_str()), options)
        .await
        .map_err(|e| e.to_string())?;
    let mut body = answer.into_stream();
    let mut filled = 0;
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let to = filled + chunk.len();
        if to > job.buffer.len() {
            return Err(format!("more than the {} bytes asked", job.buffer.len()));
        }
        job.buffer[filled..to].copy_from_slice(&chunk);
        filled = to;
    }
    if filled != job.buffer.len() {
        return Err(format!("{filled} of {} bytes", job.buffer.len()));
    }
    Ok(())
}
