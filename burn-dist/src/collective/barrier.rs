//! Barrier: no rank leaves before every rank has arrived.

use super::{Communicator, tag};
use crate::Result;

impl Communicator {
    /// Returns once every rank has called `barrier` (each rank tells every other one).
    pub fn barrier(&self) -> Result<()> {
        let op = self.next_op();
        let (r, n) = (self.rank(), self.world());
        for peer in (0..n).filter(|&p| p != r) {
            self.send(peer, tag(op, 0, 0), Vec::new())?;
        }
        for peer in (0..n).filter(|&p| p != r) {
            self.recv(peer, tag(op, 0, 0), "barrier")?;
        }
        Ok(())
    }
}
