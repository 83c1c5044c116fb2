// `&self` and `&mut self` methods: the receiver stays, the batch size is the parameter after it.
use batch_size_runtime::{find_executable_batch_size, OutOfMemory};

struct Trainer {
    capacity: usize,
    seen: Vec<usize>,
}

impl Trainer {
    #[find_executable_batch_size(starting = 64)]
    fn fits(&self, batch_size: usize) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
        if batch_size > self.capacity {
            return Err(OutOfMemory::new().into());
        }
        Ok(batch_size)
    }

    #[find_executable_batch_size(starting = 64)]
    fn train(&mut self, batch_size: u32, epochs: u32) -> anyhow::Result<u32> {
        self.seen.push(batch_size as usize);
        if batch_size as usize > self.capacity {
            anyhow::bail!(OutOfMemory::new());
        }
        Ok(batch_size * epochs)
    }

    #[find_executable_batch_size(starting = 8)]
    pub(crate) fn plain(&self, batch_size: usize) -> usize {
        batch_size + self.capacity
    }
}

trait Fit {
    fn fit(&mut self) -> anyhow::Result<u32>;
}

impl Fit for Trainer {
    #[find_executable_batch_size(starting = 16)]
    fn fit(&mut self, batch_size: u32) -> anyhow::Result<u32> {
        self.train_once(batch_size)
    }
}

impl Trainer {
    fn train_once(&mut self, batch_size: u32) -> anyhow::Result<u32> {
        if batch_size as usize > self.capacity {
            return Err(OutOfMemory::new().into());
        }
        Ok(batch_size)
    }
}

pub fn main() {
    let mut trainer = Trainer {
        capacity: 20,
        seen: Vec::new(),
    };
    assert_eq!(trainer.fits().unwrap(), 16);
    assert_eq!(trainer.train(3).unwrap(), 48);
    assert_eq!(trainer.seen, [64, 32, 16]);
    assert_eq!(trainer.plain(), 28);
    assert_eq!(trainer.fit().unwrap(), 16);
}
