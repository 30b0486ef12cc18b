//! `model::tensors`: the arch tables against what every named geometry's file holds, and
//! the byte accounting's groups against the name-based classifier `inspect` used before
//! the tables existed (kept here, verbatim in behaviour, as the reference).

use std::collections::HashSet;

use model::geometry::Geometry;
use model::synth::accounting::{Classifier, Group};
use model::synth::{plan, Preset};
use model::tensors::{self, block_of, Role};

/// The classifier `scoria inspect` used before the arch tables: by name, with the
/// blocks that hold `ssm_*` tensors telling linear-attention `attn_*` apart.
struct OldClassifier {
    nextn_start: Option<u32>,
    recurrent: HashSet<u32>,
}

impl OldClassifier {
    fn classify(&self, name: &str) -> Group {
        let block = block_of(name);
        if let (Some(b), Some(start)) = (block, self.nextn_start) {
            if b >= start {
                return Group::Mtp;
            }
        }
        let leaf = match block {
            Some(b) => name
                .strip_prefix(&format!("blk.{b}."))
                .unwrap_or(name)
                .to_string(),
            None => name.to_string(),
        };
        if leaf.contains(".nextn.") || leaf.starts_with("nextn.") {
            return Group::Mtp;
        }
        if leaf.starts_with("token_embd") {
            return Group::Embedding;
        }
        if leaf == "output.weight" || leaf.starts_with("output.") {
            return Group::Output;
        }
        if leaf.contains("norm") {
            return Group::Norms;
        }
        if leaf.contains("_exps") {
            return Group::RoutedExperts;
        }
        if leaf.contains("_shexp") {
            return Group::SharedExpert;
        }
        if leaf.starts_with("ffn_gate_inp") {
            return Group::Router;
        }
        if leaf.starts_with("ssm_") {
            return Group::LinearAttention;
        }
        if leaf.starts_with("attn_") {
            let linear = block.is_some_and(|b| self.recurrent.contains(&b));
            return if linear {
                Group::LinearAttention
            } else {
                Group::Attention
            };
        }
        Group::Other
    }
}

#[test]
fn roles_match_the_old_classifier_on_every_geometry() {
    for g in Geometry::all() {
        let names: Vec<String> = plan::plan(&g, Preset::Q4KM)
            .unwrap()
            .into_iter()
            .map(|s| s.name)
            .collect();
        let nextn_start = (g.n_nextn > 0).then_some(g.n_layer);
        let old = OldClassifier {
            nextn_start,
            recurrent: names
                .iter()
                .filter(|n| n.contains(".ssm_"))
                .filter_map(|n| block_of(n))
                .collect(),
        };
        let new = Classifier {
            nextn_start,
            table: Some(tensors::table(g.arch)),
        };
        let table = tensors::table(g.arch);
        for n in &names {
            assert_eq!(new.classify(n), old.classify(n), "{}: {n}", g.name);
            // The arch's table and the name-only lookup agree.
            let (_, def) = table.find(n).unwrap_or_else(|| panic!("{}: {n}", g.name));
            assert_eq!(Role::of(n), Some(def.role), "{}: {n}", g.name);
            // The engine's routed-expert byte count: the old rule was `_exps` in the name.
            assert_eq!(tensors::is_routed_expert(n), n.contains("_exps"), "{n}");
            assert_ne!(new.classify(n), Group::Other, "{}: {n}", g.name);
        }
    }
}

#[test]
fn instances_are_what_synth_writes() {
    for g in Geometry::all() {
        let cfg = g.config().unwrap();
        let mut from_table: Vec<(String, Vec<u64>)> = tensors::table(g.arch)
            .instances(&cfg)
            .into_iter()
            .map(|t| (t.name, t.dims.iter().map(|&d| d as u64).collect()))
            .collect();
        let mut written: Vec<(String, Vec<u64>)> = plan::plan(&g, Preset::F32)
            .unwrap()
            .into_iter()
            .map(|s| (s.name, s.dims))
            .collect();
        from_table.sort();
        written.sort();
        assert_eq!(from_table, written, "{}", g.name);
        // Routed experts are most of every real model's bytes.
        let experts: u64 = tensors::table(g.arch)
            .instances(&cfg)
            .iter()
            .filter(|t| t.def.role.is_routed_expert())
            .map(|t| t.dims.iter().map(|&d| d as u64).product::<u64>())
            .sum();
        let (rest, _) = g.n_params().unwrap();
        assert!(experts < rest, "{}", g.name);
        if !g.name.starts_with("tiny") {
            assert!(
                experts * 10 > rest * 9,
                "{}: experts {experts} of {rest}",
                g.name
            );
        }
    }
}
