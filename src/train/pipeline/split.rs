//! How the model's units are split into stages: given, balanced by parameters, by measured
//! time or by estimated memory, or as a resumed run recorded it (`pipeline_split.txt`).

use super::*;
use files::{format_split, split_file};

impl PipelineRun<'_> {
    /// The final split: the one a resumed run recorded, else measured by time
    /// (`--pipeline-balance time`), else the one given; printed with each stage's parameters.
    pub(super) fn settle_split(
        &mut self,
        pipe: &mut Pipeline,
        log: &mut dyn FnMut(&str),
    ) -> Result<()> {
        let file = split_file(&self.cfg.run_dir);
        let mut measured: Option<Vec<UnitCost>> = None;
        if self.cfg.checkpoint.resume && file.is_file() {
            self.ranges = self.recorded_split(&file)?;
        } else if self.opts.balance != PipelineBalance::Params && self.opts.split.is_none() {
            let costs = self.measure_units(pipe)?;
            self.ranges = match self.opts.balance {
                PipelineBalance::Memory => {
                    let params = self.config.unit_params(&self.plain_device)?;
                    let state = self.state_bytes_per_param();
                    balance_by(costs.len(), self.grid.stages, |s, r| {
                        stage_memory(
                            &params,
                            &costs,
                            r,
                            state,
                            self.in_flight(s),
                            self.cfg.compute.recompute,
                        )
                    })?
                }
                _ => {
                    let weights: Vec<usize> = costs
                        .iter()
                        .map(|c| ((c.seconds * 1e6).round() as usize).max(1))
                        .collect();
                    balance(&weights, self.grid.stages)?
                }
            };
            measured = Some(costs);
        }
        if self.comm.rank() == 0 {
            run_dir::write_atomic(&file, format_split(&self.ranges))?;
        }
        let weights = self.config.unit_params(&self.plain_device)?;
        log(&format!(
            "split ({}): {}",
            if measured.is_some() && self.opts.balance == PipelineBalance::Memory {
                "balanced by estimated memory"
            } else if measured.is_some() {
                "balanced by measured time"
            } else if self.cfg.checkpoint.resume {
                "as the run recorded it"
            } else if self.opts.split.is_some() {
                "as given"
            } else {
                "balanced by parameters"
            },
            format_split(&self.ranges)
        ));
        for (s, r) in self.ranges.iter().enumerate() {
            let params: usize = weights[r.clone()].iter().sum();
            let ms = measured
                .as_ref()
                .map(|c| {
                    let seconds: f64 = c[r.clone()].iter().map(|u| u.seconds).sum();
                    let memory = stage_memory(
                        &weights,
                        c,
                        r.clone(),
                        self.state_bytes_per_param(),
                        self.in_flight(s),
                        self.cfg.compute.recompute,
                    );
                    format!(
                        ", {:.1} ms per micro-batch pass, ~{:.0} MB",
                        1e3 * seconds,
                        memory / 1e6
                    )
                })
                .unwrap_or_default();
            log(&format!(
                "  stage {s}: units {}..{} of {}, {params} parameters{ms} (ranks {:?})",
                r.start,
                r.end,
                self.config.units(),
                self.grid.stage_replicas(s)
            ));
        }
        Ok(())
    }

    /// The split a resumed run recorded in `file`, refused where it does not fit this run's
    /// stages and units.
    fn recorded_split(&self, file: &std::path::Path) -> Result<Vec<std::ops::Range<usize>>> {
        let text = std::fs::read_to_string(file).map_err(|source| HearthError::Read {
            path: file.to_path_buf(),
            source,
        })?;
        let recorded = PipelineOptions::parse_split(text.trim())?;
        if recorded.len() != self.grid.stages
            || recorded.last().map(|r| r.end) != Some(self.config.units())
        {
            return Err(HearthError::InvalidArgument(format!(
                "`checkpoint.resume`: {} records the split {} for another layout than {} stages of {} units",
                file.display(),
                text.trim(),
                self.grid.stages,
                self.config.units()
            )));
        }
        Ok(recorded)
    }

    /// Time and held memory of one training pass of every unit on a micro-batch of the first
    /// batch ([`crate::pipeline::measure_units`]), measured on each unit's rank.
    fn measure_units(&self, pipe: &mut Pipeline) -> Result<Vec<UnitCost>> {
        let stage = self.init_stage()?;
        let batch = self
            .loaders
            .train
            .epoch(0, &self.device)
            .next()
            .ok_or_else(|| HearthError::Training("the training set gave no batch".into()))??;
        let n = batch.images.dims()[0];
        let x = batch.images.narrow(0, 0, self.micro_split(n)[0].1);
        crate::pipeline::measure_units(
            &stage,
            self.ranges[self.stage].start,
            self.config.units(),
            pipe,
            &self.comm,
            Activation::Rank4(x),
            &self.device,
        )
    }

    /// Bytes each parameter costs a stage: weights, gradients, their sum over micro-batches,
    /// and the optimizer's state (momentum: 1 value; Adam, AdamW, LARS: up to 2).
    fn state_bytes_per_param(&self) -> f64 {
        let optimizer_values = match self.cfg.optim.optimizer {
            crate::train::OptimizerKind::Sgd => 1.0,
            _ => 2.0,
        };
        4.0 * (3.0 + optimizer_values)
    }

    /// Micro-batches whose activations stage `s` holds at once under the schedule.
    fn in_flight(&self, s: usize) -> usize {
        self.opts
            .schedule
            .held(s, self.grid.stages, self.opts.micro_batches)
    }
}
