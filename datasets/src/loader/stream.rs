//! An epoch's batches as a stream: jobs dispatched to the decoding workers at most `prefetch`
//! ahead, batches handed out in order, the workers stopped and joined when the stream is dropped.

use super::*;

/// The loader's ways to stream an epoch (here, beside the stream they start, so that the
/// loader's module does not reach down to this one).
impl Loader {
    /// Streams this worker's batches of `epoch` per [`Loader::step_slices`] (one batch per
    /// step; a step where this worker has no sample is skipped, so the caller counts steps by
    /// [`Loader::step_slices`]'s length when it must stay in step with the others).
    pub fn epoch_steps(
        &self,
        epoch: u64,
        start: usize,
        global: usize,
        offset: usize,
        share: usize,
        device: &Device,
    ) -> BatchStream {
        let batches: Vec<Vec<usize>> = self
            .step_slices(epoch, start, global, offset, share)
            .into_iter()
            .filter(|b| !b.is_empty())
            .collect();
        BatchStream::start(self.clone(), epoch, batches, device.clone())
    }

    /// Streams the given batches (sample indices of the set, one list per batch) of `epoch`
    /// onto `device`, prefetched by the loader's workers (elastic training's own steps).
    pub fn stream(&self, epoch: u64, batches: Vec<Vec<usize>>, device: &Device) -> BatchStream {
        BatchStream::start(self.clone(), epoch, batches, device.clone())
    }

    /// Streams this rank's batches of `epoch` onto `device`.
    pub fn epoch(&self, epoch: u64, device: &Device) -> BatchStream {
        self.epoch_from(epoch, 0, self.config.rank, self.config.world_size, device)
    }

    /// Streams the rest of `epoch` from global position `start` for `rank` of `world`
    /// (elastic resharding). `start` counts samples consumed by all ranks together.
    pub fn epoch_from(
        &self,
        epoch: u64,
        start: usize,
        rank: usize,
        world: usize,
        device: &Device,
    ) -> BatchStream {
        let indices = self.shard_indices(epoch, start, rank, world.max(1));
        let batches: Vec<Vec<usize>> = indices
            .chunks(self.config.batch_size)
            .map(<[usize]>::to_vec)
            .collect();
        BatchStream::start(self.clone(), epoch, batches, device.clone())
    }
}

/// The batches of one epoch, decoded ahead by worker threads. Dropping it stops the workers.
pub struct BatchStream {
    loader: Loader,
    device: Device,
    batches: Vec<Vec<usize>>,
    next_dispatch: usize,
    next_yield: usize,
    jobs: Option<SyncSender<Job>>,
    done: Receiver<Done>,
    ready: BTreeMap<usize, Result<HostBatch>>,
    workers: Vec<JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    /// Bad files met in this epoch.
    pub problems: Vec<Problem>,
}

impl BatchStream {
    pub(super) fn start(
        loader: Loader,
        epoch: u64,
        batches: Vec<Vec<usize>>,
        device: Device,
    ) -> Self {
        let workers_n = loader.config.workers;
        let prefetch = loader.config.prefetch;
        let (job_tx, job_rx) = sync_channel::<Job>(prefetch);
        let (done_tx, done_rx) = sync_channel::<Done>(prefetch + workers_n);
        let job_rx = Arc::new(Mutex::new(job_rx));
        let stop = Arc::new(AtomicBool::new(false));
        let workers = (0..workers_n)
            .map(|_| {
                let (jobs, done, loader, stop) = (
                    job_rx.clone(),
                    done_tx.clone(),
                    loader.clone(),
                    stop.clone(),
                );
                std::thread::spawn(move || {
                    loop {
                        let job = match jobs.lock() {
                            Ok(rx) => rx.recv(),
                            Err(_) => return,
                        };
                        let Ok((i, wanted)) = job else { return };
                        if stop.load(Ordering::Relaxed) {
                            return;
                        }
                        // A panic while decoding (a decoder bug, a damaged file the
                        // checks missed) becomes this batch's error: the consumer waits for
                        // batch `i` and must hear of it, or it would wait forever.
                        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            loader.load_batch(epoch, &wanted)
                        }))
                        .unwrap_or_else(|panic| Err(loader.panicked(&wanted, panic)));
                        if done.send((i, result)).is_err() {
                            return;
                        }
                    }
                })
            })
            .collect();
        let mut stream = Self {
            loader,
            device,
            batches,
            next_dispatch: 0,
            next_yield: 0,
            jobs: Some(job_tx),
            done: done_rx,
            ready: BTreeMap::new(),
            workers,
            stop,
            problems: Vec::new(),
        };
        stream.dispatch();
        stream
    }

    /// Keeps `prefetch` batches in flight.
    fn dispatch(&mut self) {
        let limit = self.next_yield + self.loader.config.prefetch;
        while self.next_dispatch < self.batches.len() && self.next_dispatch < limit {
            let Some(tx) = &self.jobs else { return };
            let batch = std::mem::take(&mut self.batches[self.next_dispatch]);
            if tx.send((self.next_dispatch, batch)).is_err() {
                return;
            }
            self.next_dispatch += 1;
        }
        if self.next_dispatch >= self.batches.len() {
            self.jobs = None; // workers exit when the queue drains
        }
    }

    /// Batches this stream yields in total.
    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}

impl Iterator for BatchStream {
    type Item = Result<Batch>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next_yield >= self.batches.len() {
            return None;
        }
        let host = loop {
            if let Some(r) = self.ready.remove(&self.next_yield) {
                break r;
            }
            match self.done.recv() {
                Ok((i, r)) => {
                    self.ready.insert(i, r);
                }
                Err(_) => {
                    self.next_yield = self.batches.len();
                    return Some(Err(DataError::Worker(
                        "decoding threads stopped before the epoch ended".into(),
                    )));
                }
            }
        };
        self.next_yield += 1;
        self.dispatch();
        Some(host.and_then(|mut h| {
            if !h.problems.is_empty() {
                let failed = match self.loader.problems.lock() {
                    Ok(mut all) => {
                        all.extend(h.problems.iter().cloned());
                        mostly_failing(&all, self.loader.decoded_samples())
                    }
                    Err(_) => None,
                };
                self.problems.append(&mut h.problems);
                if let Some(e) = failed {
                    self.next_yield = self.batches.len();
                    return Err(e);
                }
            }
            Ok(self.loader.to_batch(h, &self.device))
        }))
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        // At most `prefetch` batches are ever in flight and the result channel holds
        // `prefetch + workers`, so no worker can block on a send: stop, close, join.
        self.stop.store(true, Ordering::Relaxed);
        self.jobs = None;
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}
