//! One step of a stage: its micro-batches forward and backward in the schedule's order, with
//! what each backward needs held between (the graph, or with recomputation the input and its
//! random seed).

use super::*;

impl Pipeline {
    /// Runs one step of `micro_batches` micro-batches through `stage` (on `device`, an autodiff
    /// device). The first stage takes its micro-batches from `inputs`; the last computes each
    /// one's loss with `loss(output, micro_batch)`. Every stage of the pipeline must call it
    /// with the same `micro_batches`.
    pub fn step<M: PipelineStage>(
        &mut self,
        stage: &M,
        inputs: &mut dyn FnMut(usize) -> Activation,
        loss: &mut dyn FnMut(Activation, usize) -> Result<Tensor<1>>,
        micro_batches: usize,
        device: &Device,
    ) -> Result<StepOutput> {
        let step = self.step;
        self.step += 1;
        // Recomputation's first passes: the stage with untracked parameters, so they build no
        // graph (batch norm still trains and updates its shared running statistics). The last
        // stage has no first pass.
        if self.recompute {
            // A parameter initialises at its first use, drawing from the random stream: it
            // must not draw inside the first pass only, or the recomputation's draws would
            // come from elsewhere in the stream.
            stage.visit(&mut Materialize);
        }
        let mut st = InFlight {
            step,
            untracked: (self.recompute && !self.is_last()).then(|| stage.clone().no_grad()),
            held: (0..micro_batches).map(|_| None).collect(),
            losses: vec![None; micro_batches],
            accumulator: GradientsAccumulator::<M>::new(),
            in_flight: 0,
            peak: 0,
            graphs: 0,
            peak_graphs: 0,
        };
        for (forward, m) in self
            .schedule
            .order(self.stage, self.stages(), micro_batches)
        {
            if forward {
                self.forward_micro(&mut st, stage, inputs, loss, m, device)?;
            } else {
                self.backward_micro(&mut st, stage, loss, m, device)?;
            }
        }
        let losses = st
            .losses
            .into_iter()
            .flatten()
            .map(|l| l.into_scalar::<f32>())
            .collect();
        Ok(StepOutput {
            grads: st.accumulator.grads(),
            losses,
            peak_in_flight: st.peak,
            peak_graphs: st.peak_graphs,
        })
    }

    /// Micro-batch `m`'s forward: its input (from `inputs` or the stage before), the stage's
    /// output on to the next stage (or its loss, on the last), and what its backward needs
    /// held (the graph, or with recomputation the input and the random seed).
    fn forward_micro<M: PipelineStage>(
        &mut self,
        st: &mut InFlight<M>,
        stage: &M,
        inputs: &mut dyn FnMut(usize) -> Activation,
        loss: &mut dyn FnMut(Activation, usize) -> Result<Tensor<1>>,
        m: usize,
        device: &Device,
    ) -> Result<()> {
        let x = if self.is_first() {
            inputs(m)
        } else {
            let data = self.recv(self.stage - 1, tag(st.step, m, true), "pipeline forward")?;
            let data = self.check_input(data, m, &|d| stage.accepts(d))?;
            let x = activation(data, device);
            if self.recompute { x } else { x.require_grad() }
        };
        st.in_flight += 1;
        st.peak = st.peak.max(st.in_flight);
        if self.recompute {
            // The last stage runs its only forward in the backward: nothing to replay.
            let mut seed = None;
            if let Some(untracked) = &st.untracked {
                let s = next_seed(&mut self.seeds);
                device.seed(s);
                seed = Some(s);
                let y = self.run(m, || untracked.forward(x.clone()))?;
                self.send(self.stage + 1, tag(st.step, m, true), y.data())?;
            }
            st.held[m] = Some(Held::Input(x, seed));
            return Ok(());
        }
        let y = self.run(m, || stage.forward(x.clone()))?;
        if self.is_last() {
            st.losses[m] = Some(loss(y.clone(), m)?);
        } else {
            self.send(self.stage + 1, tag(st.step, m, true), y.data())?;
        }
        st.held[m] = Some(Held::Graph(x, y));
        st.graphs += 1;
        st.peak_graphs = st.peak_graphs.max(st.graphs);
        Ok(())
    }

    /// Micro-batch `m`'s backward: its graph (built again from the held input with
    /// recomputation), the gradient from the loss or the stage after, the input's gradient to
    /// the stage before, the parameters' gradients accumulated.
    fn backward_micro<M: PipelineStage>(
        &mut self,
        st: &mut InFlight<M>,
        stage: &M,
        loss: &mut dyn FnMut(Activation, usize) -> Result<Tensor<1>>,
        m: usize,
        device: &Device,
    ) -> Result<()> {
        let (x, y) = match st.held[m].take() {
            Some(Held::Graph(x, y)) => (x, y),
            Some(Held::Input(x, seed)) => {
                // The forward again, with its graph, on the same draws.
                if let Some(seed) = seed {
                    device.seed(seed);
                }
                let x = if self.is_first() { x } else { x.require_grad() };
                let y = if self.is_last() {
                    let y = self.run(m, || stage.forward(x.clone()))?;
                    st.losses[m] = Some(loss(y.clone(), m)?);
                    y
                } else {
                    self.run(m, || stage.forward_again(x.clone()))?
                };
                st.graphs += 1;
                st.peak_graphs = st.peak_graphs.max(st.graphs);
                (x, y)
            }
            None => {
                return Err(mismatch(
                    "pipeline backward",
                    format!("micro-batch {m} has no forward on stage {}", self.stage),
                ));
            }
        };
        st.in_flight -= 1;
        st.graphs -= 1;
        let grads = if self.is_last() {
            let Some(l) = st.losses[m].clone() else {
                return Err(mismatch(
                    "pipeline backward",
                    format!("no loss for micro-batch {m}"),
                ));
            };
            l.backward()
        } else {
            let upstream =
                self.recv(self.stage + 1, tag(st.step, m, false), "pipeline backward")?;
            if !y.is_tracked() {
                // Nothing to differentiate: a stage with nothing to train whose input carries
                // no gradient (a frozen first stage in transfer learning).
                return Ok(());
            }
            y.inject(upstream, device)
                .map_err(|e| mismatch("pipeline backward", format!("stage {}: {e}", self.stage)))?
                .backward()
        };
        if !self.is_first() {
            let dx = x.grad(&grads).ok_or_else(|| {
                mismatch(
                    "pipeline backward",
                    format!("stage {}'s input got no gradient", self.stage),
                )
            })?;
            self.send(self.stage - 1, tag(st.step, m, false), dx)?;
        }
        st.accumulator
            .accumulate(stage, GradientsParams::from_grads(grads, stage));
        Ok(())
    }

    /// `forward()` of micro-batch `m`, its error naming this stage and the micro-batch.
    fn run(&self, m: usize, forward: impl FnOnce() -> Result<Activation>) -> Result<Activation> {
        forward().map_err(|e| {
            mismatch(
                "pipeline forward",
                format!("stage {} on micro-batch {m}: {e}", self.stage),
            )
        })
    }
}

/// One step's micro-batches on this stage: what each one's backward needs, the last stage's
/// losses, the parameters' gradients so far, and the counts of micro-batches in flight and
/// graphs held (with their peaks).
struct InFlight<M: PipelineStage> {
    step: u64,
    /// With recomputation, the stage with untracked parameters for the first passes.
    untracked: Option<M>,
    held: Vec<Option<Held>>,
    losses: Vec<Option<Tensor<1>>>,
    accumulator: GradientsAccumulator<M>,
    in_flight: usize,
    peak: usize,
    graphs: usize,
    peak_graphs: usize,
}

/// What a stage keeps of a micro-batch between its forward and its backward.
// One per micro-batch in flight (a handful): boxing the graph would add an allocation each.
#[allow(clippy::large_enum_variant)]
enum Held {
    /// The input (to send its gradient back) and the output, with its graph.
    Graph(Activation, Activation),
    /// Recomputation: the input alone (untracked), and the seed its first pass's random draws
    /// (dropout) came from, so that the recomputation draws the same (none on the last
    /// stage, which has no first pass).
    Input(Activation, Option<u64>),
}

/// splitmix64: the next seed of a stream.
fn next_seed(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}
