//! The names settings enums take on the command line and in `hparams.json`, without clap: the
//! library reads and writes them itself, and the command line (through the `clap` feature) derives
//! clap's `ValueEnum` with the same names (`tests` below check that they agree).

/// For a settings enum: `ALL`, `name()` and `from_name()`, and `FromStr` with an error that
/// lists the names.
macro_rules! named_settings {
    ($ty:ident { $($variant:ident => $name:literal),+ $(,)? }) => {
        impl $ty {
            /// Every value, in the order the command line lists them.
            pub const ALL: &'static [$ty] = &[$($ty::$variant),+];

            /// The name the command line and `hparams.json` use.
            pub fn name(self) -> &'static str {
                match self {
                    $($ty::$variant => $name),+
                }
            }

            /// The value named `name` (ASCII case ignored).
            pub fn from_name(name: &str) -> Option<Self> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|v| v.name().eq_ignore_ascii_case(name))
            }
        }

        impl crate::names::Named for $ty {
            fn setting_name(self) -> &'static str {
                self.name()
            }
            fn from_setting_name(name: &str) -> Option<Self> {
                Self::from_name(name)
            }
        }

        impl std::str::FromStr for $ty {
            type Err = crate::HearthError;

            fn from_str(s: &str) -> crate::Result<Self> {
                Self::from_name(s).ok_or_else(|| {
                    crate::HearthError::InvalidArgument(format!(
                        "{s:?} is not one of: {}",
                        Self::ALL
                            .iter()
                            .map(|v| v.name())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ))
                })
            }
        }
    };
}

pub(crate) use named_settings;

/// A settings enum that reads and writes itself by name (`hparams.json` through serde:
/// `#[serde(with = "crate::names::by_name")]`).
pub(crate) trait Named: Sized + Copy {
    fn setting_name(self) -> &'static str;
    fn from_setting_name(name: &str) -> Option<Self>;
}

impl Named for burn_dist::Compression {
    fn setting_name(self) -> &'static str {
        self.name()
    }
    fn from_setting_name(name: &str) -> Option<Self> {
        Self::from_name(name)
    }
}

impl Named for burn_dist::pipeline::Schedule {
    fn setting_name(self) -> &'static str {
        self.name()
    }
    fn from_setting_name(name: &str) -> Option<Self> {
        Self::from_name(name)
    }
}

impl Named for burn_dist::ps::Mode {
    fn setting_name(self) -> &'static str {
        self.name()
    }
    fn from_setting_name(name: &str) -> Option<Self> {
        name.parse().ok()
    }
}

/// serde by a [`Named`] enum's name.
pub(crate) mod by_name {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(crate) fn serialize<T: super::Named, S: Serializer>(
        v: &T,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(v.setting_name())
    }

    pub(crate) fn deserialize<'de, T: super::Named, D: Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        let name = String::deserialize(d)?;
        T::from_setting_name(&name)
            .ok_or_else(|| D::Error::custom(format!("{name:?} is not a name this version knows")))
    }
}

#[cfg(all(test, feature = "clap"))]
mod tests {
    use clap::ValueEnum;

    /// Every value's library name is the command line's, and reads back.
    fn agree<T: ValueEnum + Copy + PartialEq + std::fmt::Debug>(
        all: &[T],
        name: fn(T) -> &'static str,
        from: fn(&str) -> Option<T>,
    ) {
        assert_eq!(all.len(), T::value_variants().len(), "{all:?}");
        for v in all {
            let clap_name = v.to_possible_value().map(|p| p.get_name().to_string());
            assert_eq!(clap_name.as_deref(), Some(name(*v)), "{v:?}");
            assert_eq!(from(name(*v)), Some(*v));
        }
    }

    #[test]
    fn library_names_are_the_command_lines() {
        use crate::train::*;
        agree(FinetuneBn::ALL, FinetuneBn::name, FinetuneBn::from_name);
        agree(
            OptimizerKind::ALL,
            OptimizerKind::name,
            OptimizerKind::from_name,
        );
        agree(Monitor::ALL, Monitor::name, Monitor::from_name);
        agree(
            AugmentPreset::ALL,
            AugmentPreset::name,
            AugmentPreset::from_name,
        );
        agree(
            PipelineBalance::ALL,
            PipelineBalance::name,
            PipelineBalance::from_name,
        );
        agree(Precision::ALL, Precision::name, Precision::from_name);
        agree(Balance::ALL, Balance::name, Balance::from_name);
        use crate::schedule::{LrScaling, ScheduleKind};
        agree(
            ScheduleKind::ALL,
            ScheduleKind::name,
            ScheduleKind::from_name,
        );
        agree(LrScaling::ALL, LrScaling::name, LrScaling::from_name);
        use burn_dist::{Compression, pipeline::Schedule};
        agree(Compression::ALL, Compression::name, Compression::from_name);
        agree(Schedule::ALL, Schedule::name, Schedule::from_name);
    }

    #[test]
    fn a_wrong_name_is_refused_listing_the_right_ones() {
        let err = "adamx"
            .parse::<crate::train::OptimizerKind>()
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"adamx\"") && err.contains("sgd, adam, adamw, lars"),
            "{err}"
        );
        assert_eq!(
            "AdamW".parse::<crate::train::OptimizerKind>().ok(),
            Some(crate::train::OptimizerKind::AdamW)
        );
    }
}
