//! `--zero 1|2` in elastic training: each worker keeps its shard of the optimizer state
//! (burn-dist's [`ZeroOptimizer`]) and a replica of the next worker's, so that a worker lost
//! without warning takes nothing with it; a change of membership re-shards the state over the
//! new world ([`ZeroOptimizer::reshard_from`]) instead of dropping it.
//!
//! Versions. A step ends with an all-gather of the updated segments, which can fail on some
//! workers after others finished it; the new world takes its rank 0's commit, which may be a
//! step before or after a member's own. So a member keeps, besides the shard of its commit,
//! the shard before the last step until every worker is known to have finished that step (a
//! one-value allreduce after the commit), and after a step that failed in its all-gather, the
//! shard with that step's local update applied (every member updated its segments before
//! sending them, so if anyone finished the step, everyone holds its update). After a change
//! each member takes the version of rank 0's step.
//!
//! Files. The state is streamed to rank 0 a bucket at a time, into
//! `checkpoint/elastic-zero/optim-zero-<step>.safetensors` (`train::zero`'s format: whole
//! named tensors, so a resume re-shards it over any number of workers), before
//! `checkpoint/elastic.state` names that step. Every member takes part, so it is written at
//! every epoch's end and when every worker leaves; a worker left below `--min-workers`
//! cannot write it alone, and says the last epoch's state stands.

use super::shard::{Sharded, state_dir};
use super::*;
use crate::train::zero;
use burn_dist::zero::{Stage, ZeroOptimizer};

impl<T: Trainee> ElasticRun<'_, T> {
    /// A fresh shard of `model`'s trainable tensors for `world` (summed weighted gradients,
    /// with a replica of the next worker's shard).
    fn new_shard(&self, world: &World, model: &T::Model) -> Result<ZeroOptimizer> {
        let stage = Stage::from_number(self.cfg.exchange.zero)?;
        let optimizer = crate::train::flat::model_optimizer(
            self.cfg,
            self.cfg.optim.lr,
            self.batches_per_epoch,
            model,
        )?;
        let names = burn_dist::flat::module::trainable_names(model);
        Ok(ZeroOptimizer::new(
            stage,
            &names,
            optimizer,
            &world.sharded,
            self.cfg.exchange.bucket_size(),
        )?
        .with_summed_gradients()
        .with_replica()
        .with_clip_norm(self.cfg.optim.clip_grad))
    }

    /// The first world's shards: fresh, or (`--resume`) the saved state of the commit's step
    /// read by rank 0 and handed out.
    pub(super) fn first_shards(
        &self,
        world: &World,
        commit: &Commit<T::Model>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Sharded> {
        let mut z = self.new_shard(world, &commit.model)?;
        if self.cfg.checkpoint.resume && commit.step > 0 {
            let path = zero::state_file(&state_dir(self.cfg), commit.step as usize);
            let mut read =
                (world.rank() == 0).then(|| zero::open_state(&path).map_err(|e| e.to_string()));
            z.scatter_from_reader(
                &world.sharded,
                0,
                read.as_mut().map(|r| {
                    r.as_mut()
                        .map(|f| f as &mut dyn burn_dist::zero::StateReader)
                        .map_err(|e| e.clone())
                }),
            )?;
            if world.rank() == 0 {
                log(&format!(
                    "optimizer state of step {} from {}, sharded over {} workers",
                    commit.step,
                    path.display(),
                    world.size()
                ));
            }
        }
        Ok(self.shards_from(world, z, commit.step, log))
    }

    /// `z` as the shard of step `step`, said by rank 0.
    fn shards_from(
        &self,
        world: &World,
        z: ZeroOptimizer,
        step: u64,
        log: &mut dyn FnMut(&str),
    ) -> Sharded {
        if world.rank() == 0 {
            log(&format!(
                "`exchange.zero` {}: worker 0 updates {} ({} optimizer values held)",
                self.cfg.exchange.zero,
                z.describe(),
                z.state_len()
            ));
        }
        Sharded {
            current: z,
            since: step,
            previous: None,
            pending: None,
        }
    }

    /// After a change: this member's shard in the new world, re-sharded from every old
    /// member's version of rank 0's step (`old`: this member's shards and the step it had
    /// committed; `None` for a joiner).
    pub(super) fn reshard(
        &self,
        world: &World,
        commit: &Commit<T::Model>,
        old: Option<(Sharded, u64)>,
        log: &mut dyn FnMut(&str),
    ) -> Result<Sharded> {
        // A member whose version cannot be found still takes part (with none), so the
        // others fail with it rather than wait.
        let (version, problem) = match old.map(|(s, mine)| s.version(mine, commit.step)) {
            Some(Ok(v)) => (Some(v), None),
            Some(Err(e)) => (None, Some(e)),
            None => (None, None),
        };
        let mut z = self.new_shard(world, &commit.model)?;
        let moved = z.reshard_from(&world.sharded, version.as_ref());
        drop(version);
        if let Some(e) = problem {
            return Err(e);
        }
        moved.map_err(|e| {
            HearthError::Training(format!(
                "{e}; `checkpoint.resume` continues from the last state saved in {}",
                self.state_file().display()
            ))
        })?;
        Ok(self.shards_from(world, z, commit.step, log))
    }

    /// Streams the committed shards' state to rank 0, which writes the file of step `step`
    /// (every member calls it).
    pub(super) fn save_shards(&self, world: &World, step: u64) -> Result<()> {
        let Some(z) = &self.zero else {
            return Ok(());
        };
        if world.rank() == 0 {
            self.fenced()?;
        }
        zero::save_state(
            &state_dir(self.cfg),
            step as usize,
            &z.current,
            &world.sharded,
        )
    }

    /// Rank 0, after `checkpoint/elastic.state` names step `keep`: the older state files go.
    pub(super) fn prune_shards(&self, keep: u64) {
        let dir = state_dir(self.cfg);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        let keep = zero::state_file(&dir, keep as usize);
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if p != keep && name.starts_with("optim-zero-") {
                let _ = std::fs::remove_file(p);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn_dist::Communicator;
    use burn_dist::flat::optim::ShardOptimizer;
    use burn_dist::transport::memory::MemoryTransport;
    use burn_dist::zero::{FlatSource, Stage, ZeroOptimizer};

    use super::Sharded;

    /// A one-rank shard after `n` updates (its update count tells the versions apart).
    fn shard(n: u64) -> ZeroOptimizer {
        let t = MemoryTransport::mesh(1).remove(0);
        let comm = Communicator::from_env(Arc::new(t));
        let tensors = vec![("w".to_string(), 3)];
        let mut z = ZeroOptimizer::new(
            Stage::Two,
            &tensors,
            ShardOptimizer::sgd(0.1, 0.9),
            &comm,
            1 << 20,
        )
        .unwrap();
        for _ in 0..n {
            let mut src = FlatSource {
                grad: &[1.0, 2.0, 3.0],
                values: &[0.0; 3],
                offsets: vec![0, 3],
            };
            z.step(&comm, &mut src, 0.1, &mut |f| f).unwrap();
        }
        z
    }

    fn sharded(since: u64, previous: Option<(u64, u64)>, pending: Option<u64>) -> Sharded {
        Sharded {
            current: shard(2),
            since,
            previous: previous.map(|(s, n)| (s, shard(n))),
            pending: pending.map(|n| {
                let mut z = shard(n);
                // A step that failed after its local update: applied one more than counted.
                z.confirm_applied();
                z
            }),
        }
    }

    #[test]
    fn a_member_takes_the_version_of_rank_0_s_step() {
        // Rank 0 at this member's step: the current shard.
        assert_eq!(
            sharded(7, Some((5, 1)), None)
                .version(7, 7)
                .unwrap()
                .updates(),
            2
        );
        // Rank 0 a step behind (its all-gather failed, this member's did not): the previous.
        assert_eq!(
            sharded(7, Some((5, 1)), None)
                .version(7, 6)
                .unwrap()
                .updates(),
            1
        );
        // Rank 0 a step ahead, this member's all-gather failed after its update: the pending.
        assert_eq!(
            sharded(7, None, Some(3)).version(7, 8).unwrap().updates(),
            3
        );
        // Rank 0 a step ahead and nothing pending: that step was skipped (fp16), the same.
        assert_eq!(sharded(7, None, None).version(7, 8).unwrap().updates(), 2);
        // A pending update not taken when rank 0 is at this member's step.
        assert_eq!(
            sharded(7, None, Some(3)).version(7, 7).unwrap().updates(),
            2
        );
        // Skipped steps keep the shard: valid from `since` on.
        assert_eq!(sharded(4, None, None).version(7, 5).unwrap().updates(), 2);
        // Out of reach: an error naming both steps.
        let e = sharded(7, None, None)
            .version(7, 5)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("step 5") && e.contains("step 7"), "{e}");
        assert!(sharded(7, Some((6, 1)), None).version(7, 5).is_err());
    }
}
